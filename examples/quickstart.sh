#!/usr/bin/env bash
# Quickstart: builds idemproxy and the demo "legacy payments API", runs the
# demo on 127.0.0.1:3000 and the proxy (memory store) on 127.0.0.1:8080
# (admin on 127.0.0.1:9901). Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
./target/release/demo-upstream --listen 127.0.0.1:3000 &
demo=$!
./target/release/idemproxy --config config/quickstart.toml &
proxy=$!
trap 'kill $demo $proxy 2>/dev/null' EXIT INT TERM
for _ in $(seq 100); do
  for pid in $demo $proxy; do
    kill -0 "$pid" 2>/dev/null || { echo "quickstart: a process exited (is port 3000, 8080 or 9901 taken?)" >&2; exit 1; }
  done
  if curl -fs --max-time 1 http://127.0.0.1:9901/readyz >/dev/null 2>&1; then
    echo "idemproxy is ready on http://127.0.0.1:8080 (Ctrl-C to stop)"
    wait
    exit 0
  fi
  sleep 0.1
done
echo "quickstart: idemproxy did not become ready" >&2
exit 1
