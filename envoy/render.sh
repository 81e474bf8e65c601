#!/usr/bin/env bash
# render.sh OUT CONFIG_JSON: writes envoy/local.yaml.tmpl with the demo's fixed ports.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out=$1 config=${2:-"{}"}
mkdir -p "$(dirname "$out")" "$root/.run"
# The JSON goes into a single-quoted YAML string through sed: escape both.
config=${config//\'/\'\'}
config=${config//&/\\&}
config=${config//#/\\#}
printf '{"ok":true}\n' > "$root/.run/direct.json"
sed -e "s#@ADMIN_PORT@#${ADMIN_PORT:-9901}#" \
    -e "s#@LISTEN_PORT@#${EDGE_PORT:-10000}#" \
    -e "s#@DIRECT_PORT@#${DIRECT_PORT:-10001}#" \
    -e "s#@PLAIN_PORT@#${PLAIN_PORT:-10002}#" \
    -e "s#@MOCK_PORT@#${MOCK_PORT:-18000}#" \
    -e "s#@WASM@#$root/target/plugin/holysheep_edge.wasm#" \
    -e "s#@DIRECT_BODY@#$root/.run/direct.json#" \
    -e "s#@CONFIG@#${config}#" \
    "$root/envoy/local.yaml.tmpl" > "$out"
