# syntax=docker/dockerfile:1
# idemproxy: multi-stage build; the runtime image is distroless (no shell), non-root.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so that source changes do not rebuild them: the
# workspace's manifests with empty sources (every member must be there for
# Cargo to read the workspace; tests/dockerfile.rs runs these steps).
COPY Cargo.toml Cargo.lock ./
COPY crates/proxy/Cargo.toml crates/proxy/
COPY crates/store/Cargo.toml crates/store/
COPY crates/kube/Cargo.toml crates/kube/
COPY crates/campaign/Cargo.toml crates/campaign/
COPY crates/testkit/Cargo.toml crates/testkit/
RUN mkdir -p src examples/demo-upstream crates/proxy/src crates/store/src crates/kube/src crates/campaign/src crates/testkit/src \
 && echo 'fn main() {}' > src/main.rs \
 && echo 'fn main() {}' > examples/demo-upstream/main.rs \
 && echo 'fn main() {}' > crates/campaign/src/main.rs \
 && touch crates/proxy/src/lib.rs crates/store/src/lib.rs crates/kube/src/lib.rs crates/testkit/src/lib.rs \
 && cargo build --release --locked --bin idemproxy --bin demo-upstream \
 && rm -rf src examples crates/proxy/src crates/store/src crates/kube/src crates/campaign/src crates/testkit/src
COPY src ./src
COPY crates ./crates
COPY examples ./examples
# The PostgreSQL store's schema is compiled in (include_str!).
COPY deploy/postgres/schema.sql ./deploy/postgres/
RUN touch src/main.rs crates/proxy/src/lib.rs crates/store/src/lib.rs crates/kube/src/lib.rs examples/demo-upstream/main.rs \
 && cargo build --release --locked --bin idemproxy --bin demo-upstream

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY --from=build /src/target/release/demo-upstream /usr/local/bin/demo-upstream
# Defaults; mount a file over /etc/idemproxy/idemproxy.toml (or set IDEMPROXY_CONFIG) to override.
COPY config/ /etc/idemproxy/
ENV IDEMPROXY_CONFIG=/etc/idemproxy/idemproxy.toml
USER 65532:65532
EXPOSE 8080 9901
ENTRYPOINT ["/usr/local/bin/idemproxy"]
