#!/usr/bin/env bash
# The demo: set up, start the mock HolySheep and Envoy (2 workers) with the plugin, and
# print a curl that shows MISS then HIT. Ctrl-C (or envoy/stop.sh) stops both.
# HOLYSHEEP_SHELL=native (`make run-native`): the native module in place of the plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
. envoy/demo.sh
prepare

CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600}}'}
SHELL_KIND=${HOLYSHEEP_SHELL:-plugin}
SHELL_NAME=plugin
if [ "$SHELL_KIND" = native ]; then
  SHELL_NAME="native module"
  cargo build --profile native --features native --lib
  export ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$PWD/target/native"
fi
printf '{"ok":true}\n' > .run/direct.json
target/debug/envoy-render local .run/envoy.yaml --config "$CONFIG" --admin-port "${ADMIN_PORT:-9901}" \
  --listen-port "${EDGE_PORT:-10000}" --direct-port "${DIRECT_PORT:-10001}" --plain-port "${PLAIN_PORT:-10002}" \
  --mock-port "${MOCK_PORT:-18000}" --direct-body .run/direct.json --shell "$SHELL_KIND"

start_mock "127.0.0.1:${MOCK_PORT:-18000}"
.venv/bin/envoy -c .run/envoy.yaml --concurrency "${CONCURRENCY:-2}" --disable-hot-restart -l info > .run/envoy.log 2>&1 &
echo $! > .run/envoy.pid
trap 'envoy/stop.sh' INT TERM

await_envoy "${ADMIN_PORT:-9901}" .run/envoy.log

demo "http://127.0.0.1:${EDGE_PORT:-10000}/v1/chat/completions" \
  "Envoy on :${EDGE_PORT:-10000} with the $SHELL_NAME (admin :${ADMIN_PORT:-9901})" ".run/envoy.log .run/mock.log"
wait "$(cat .run/envoy.pid)"
