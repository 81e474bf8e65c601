#!/usr/bin/env bash
# The demo: set up, start the mock HolySheep and Envoy (2 workers) with the plugin, and
# print a curl that shows MISS then HIT. Ctrl-C (or envoy/stop.sh) stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
envoy/setup.sh
cargo build --quiet --release -p host-test --bin mock-holysheep
mkdir -p .run
envoy/stop.sh >/dev/null 2>&1 || true

CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600}}'}
envoy/render.sh .run/envoy.yaml "$CONFIG"

./target/release/mock-holysheep --listen "127.0.0.1:${MOCK_PORT:-18000}" --latency-ms "${MOCK_LATENCY_MS:-400}" > .run/mock.log 2>&1 &
echo $! > .run/mock.pid
.venv/bin/envoy -c .run/envoy.yaml --concurrency "${CONCURRENCY:-2}" --disable-hot-restart -l info > .run/envoy.log 2>&1 &
echo $! > .run/envoy.pid
trap 'envoy/stop.sh' INT TERM

for _ in $(seq 1 200); do
  curl -fs "http://127.0.0.1:${ADMIN_PORT:-9901}/ready" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fs "http://127.0.0.1:${ADMIN_PORT:-9901}/ready" >/dev/null || { tail -20 .run/envoy.log; exit 1; }

. envoy/demo.sh
demo "http://127.0.0.1:${EDGE_PORT:-10000}/v1/chat/completions" \
  "Envoy on :${EDGE_PORT:-10000} (admin :${ADMIN_PORT:-9901})" ".run/envoy.log .run/mock.log"
wait "$(cat .run/envoy.pid)"
