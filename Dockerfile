# syntax=docker/dockerfile:1
# idemproxy: multi-stage build; the runtime image is distroless (no shell), non-root.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so that source changes do not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src examples/demo-upstream \
 && echo 'fn main() {}' > src/main.rs \
 && echo 'fn main() {}' > examples/demo-upstream/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked --bins \
 && rm -rf src examples
COPY src ./src
COPY examples ./examples
RUN touch src/main.rs src/lib.rs examples/demo-upstream/main.rs \
 && cargo build --release --locked --bins

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY --from=build /src/target/release/demo-upstream /usr/local/bin/demo-upstream
# Defaults; mount a file over /etc/idemproxy/idemproxy.toml (or set IDEMPROXY_CONFIG) to override.
COPY config/ /etc/idemproxy/
ENV IDEMPROXY_CONFIG=/etc/idemproxy/idemproxy.toml
USER 65532:65532
EXPOSE 8080 9901
ENTRYPOINT ["/usr/local/bin/idemproxy"]
