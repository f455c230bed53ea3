#!/usr/bin/env bash
# Quickstart: builds idemproxy and the demo "legacy payments API", runs the
# demo on 127.0.0.1:3000 and the proxy (memory store) on 127.0.0.1:8080
# (admin on 127.0.0.1:9901). Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
./target/release/demo-upstream --listen 127.0.0.1:3000 &
./target/release/idemproxy --config config/quickstart.toml &
trap 'kill $(jobs -p) 2>/dev/null' EXIT INT TERM
for _ in $(seq 100); do
  curl -fs http://127.0.0.1:9901/readyz >/dev/null 2>&1 && break
  sleep 0.1
done
echo "idemproxy is ready on http://127.0.0.1:8080 (Ctrl-C to stop)"
wait
