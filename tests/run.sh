#!/usr/bin/env bash
# The test suite with everything it needs, on a fresh Debian machine with Rust:
#
#   tests/run.sh [NEXTEST_ARGS...]   set up, then `cargo nextest run --workspace NEXTEST_ARGS...`
#   tests/run.sh --setup-only        set up and stop (CI does this before its lints)
#
# Set-up is idempotent and quick once done (a second run only checks):
#   1. Debian packages the tests start or call, when missing (as root, or with sudo):
#      redis-server, redis-cli, PostgreSQL, Prometheus and promtool, openssl, curl,
#      python3 with venv, and the real upstream frameworks' Go, Ruby on Rails and npm;
#   2. the Python peers' virtual environment, TARGET/peers-venv (TARGET is
#      $CARGO_TARGET_DIR or ./target): the real clients and validators the tests drive;
#   3. the upstream frameworks (tests/frameworks/setup.sh: Flask, FastAPI, aiohttp,
#      Django REST framework, Express 4 and 5, Go's ServeMux, Rails; its Flask also
#      runs tests/conformance.rs's in-app implementation);
#   4. cargo-nextest, when `cargo nextest` is missing (`cargo install --locked`, a few
#      minutes on 2 cores, once).
# Then every test of the workspace runs: the proxy's and the fault campaign's.
set -euo pipefail
cd "$(dirname "$0")/.."

setup_only=false
if [ "${1:-}" = --setup-only ]; then
  setup_only=true
  shift
fi
started=$SECONDS
say() { echo "== tests/run.sh: $*"; }

# 1. Debian packages.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)   # cluster creation
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)          # test certificates
command -v curl >/dev/null 2>&1 || need_apt+=(curl)                # HTTP/2 (h2c) peer
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-venv)
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  need_apt+=(python3-venv)                                         # a python3 without venv
fi
# promtool checks the alert rules; tests/dashboards.rs runs a real prometheus.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  need_apt+=(prometheus)
fi
# The PostgreSQL store's tests start their own servers (initdb, postgres,
# pg_basebackup, pg_ctl from /usr/lib/postgresql/*/bin) as the postgres user.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ! id postgres >/dev/null 2>&1; then
  need_apt+=(postgresql)
fi
# The real upstream frameworks (tests/route_agreement.rs).
command -v go >/dev/null 2>&1 || need_apt+=(golang-go)
ruby -e 'require "action_controller/railtie"' >/dev/null 2>&1 || need_apt+=(ruby-railties)
command -v puma >/dev/null 2>&1 || need_apt+=(puma)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "tests/run.sh: these Debian packages are missing: ${need_apt[*]}" >&2
    echo "install them as root (apt-get install ${need_apt[*]}) and run tests/run.sh again" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Debian's packages start a redis-server on 6379, a prometheus on 9090 and a
# postgresql on 5432 (where systemd runs): the tests never use them (each test
# starts its own on a free port).

# 2. The Python peers: grpcio with a retry policy, urllib3 with its Retry; for
# the tracing tests an OTLP receiver (opentelemetry-proto's TraceService on
# grpcio), a client instrumented with the OpenTelemetry SDK and the SDK's own
# OTLP exporters, and the semantic conventions' registry the spans are checked
# against (tests/peers/semconv_check.py); for tests/inject.rs and
# tests/injector.rs kubernetes-validate (strict, 1.29 and 1.37) and jsonpatch; for tests/openapi.rs
# openapi-spec-validator (the annotated documents, 3.0 and 3.1). What an older venv lacks is installed
# into it; the tests find its interpreter through IDEMPROXY_TEST_PYTHON.
target="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
peers="$target/peers-venv"
peer_pkgs=('grpcio~=1.85' 'urllib3~=2.8' 'protobuf' 'opentelemetry-api~=1.45'
  'opentelemetry-sdk~=1.45' 'opentelemetry-proto~=1.45' 'opentelemetry-semantic-conventions~=0.66b0'
  'opentelemetry-exporter-otlp-proto-grpc~=1.45' 'opentelemetry-exporter-otlp-proto-http~=1.45'
  'kubernetes-validate' 'jsonpatch' 'openapi-spec-validator~=0.9')
peer_modules='grpc, urllib3, google.protobuf, opentelemetry.sdk.trace, opentelemetry.semconv.attributes.http_attributes, opentelemetry.semconv._incubating.attributes, opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, opentelemetry.exporter.otlp.proto.http.trace_exporter, kubernetes_validate, jsonpatch, openapi_spec_validator'
if ! "$peers/bin/python" -c 'import sys' >/dev/null 2>&1; then
  say "making the venv $peers"
  python3 -m venv --clear "$peers"
fi
if ! "$peers/bin/python" -c "import $peer_modules" >/dev/null 2>&1; then
  say "installing ${peer_pkgs[*]} into $peers"
  # python -m pip, not bin/pip: a venv copied from another tree keeps that pip's #! line
  "$peers/bin/python" -m pip install --quiet --disable-pip-version-check "${peer_pkgs[@]}"
  "$peers/bin/python" -c "import $peer_modules"
fi
export IDEMPROXY_TEST_PYTHON="$peers/bin/python"

# 3. The upstream frameworks, under the same target directory the tests use.
bash tests/frameworks/setup.sh "$target"

# 4. cargo-nextest.
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
export PATH="$PATH:$cargo_bin"
if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest into $cargo_bin (once; a few minutes)"
  cargo install cargo-nextest --locked --quiet
fi

# The test build takes about 5 GB (docs/dev/development.md#tests); a full disk
# shows as a linker's bus error, far from its cause.
free_kb=$(df -Pk "$target" | awk 'NR == 2 { print $4 }')
if [ -n "$free_kb" ] && [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
  say "warning: only $((free_kb / 1024)) MiB free under $target; the test build needs about 5 GB"
fi

say "set up in $((SECONDS - started)) s"
if $setup_only; then
  exit 0
fi
say "cargo nextest run --workspace $*"
exec cargo nextest run --workspace "$@"
