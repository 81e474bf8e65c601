#!/usr/bin/env bash
# The component demo: set up, start the mock HolySheep and the wasi:http component on the
# wasmtime host (`host-test serve --component`), and print a curl that shows MISS then HIT.
# Ctrl-C (or envoy/stop.sh) stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
. envoy/demo.sh
prepare serve

CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600}}'}
MOCK=127.0.0.1:${MOCK_PORT:-18000}
EDGE=127.0.0.1:${EDGE_PORT:-10000}

start_mock "$MOCK"
./target/host/host-test serve --component target/wasm32-wasip2/release/holysheep_edge.wasm \
  --config "$CONFIG" --listen "$EDGE" --upstream "$MOCK" > .run/component.log 2>&1 &
echo $! > .run/component.pid
trap 'envoy/stop.sh' INT TERM

for _ in $(seq 1 200); do
  grep -q "http://" .run/component.log 2>/dev/null && break
  sleep 0.1
done
grep -q "http://" .run/component.log || { tail -20 .run/component.log; exit 1; }

demo "http://$EDGE/v1/chat/completions" "the wasi:http component on the wasmtime host, :${EDGE_PORT:-10000}" \
  ".run/component.log .run/mock.log"
wait "$(cat .run/component.pid)"
