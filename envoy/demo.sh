#!/usr/bin/env bash
# Sourced by the demos (envoy/run.sh, run-cluster.sh, run-component.sh): what they share.

# The prompt every demo sends.
DEMO_BODY='{"model":"gpt-4.1","messages":[{"role":"user","content":"Name three sheep breeds."}],"temperature":0}'

# `prepare [serve]`: Envoy and the builds (envoy/setup.sh); the mock HolySheep and the
# template renderer (target/debug/: small, no wasmtime); with `serve` also `host-test
# serve`, the wasmtime host built for speed (target/host/); and a .run/ with nothing of an
# earlier demo still running. Cargo shows its progress: a first build takes a while.
prepare() {
  envoy/setup.sh
  if [ ! -x target/debug/mock-holysheep ] || [ ! -x target/debug/envoy-render ]; then
    echo "building the mock HolySheep and the template renderer (first run only, about 15 s)..."
  fi
  cargo build -p holysheep-mock -p envoy-render
  if [ "${1:-}" = serve ]; then
    rustup target add wasm32-wasip2 >/dev/null
    cargo build --release --target wasm32-wasip2
    [ -x target/host/host-test ] ||
      echo "building host-test serve, the wasmtime host (first run only: wasmtime at opt-level 3, about 9 min on two cores)..."
    cargo build --profile host -p host-test --bin host-test
  fi
  mkdir -p .run
  envoy/stop.sh >/dev/null 2>&1 || true
}

# `start_mock ADDR`: the mock HolySheep in the background (.run/mock.log, .run/mock.pid).
start_mock() {
  ./target/debug/mock-holysheep --listen "$1" --latency-ms "${MOCK_LATENCY_MS:-400}" > .run/mock.log 2>&1 &
  echo $! > .run/mock.pid
}

# `await_envoy ADMIN_PORT LOG`: waits up to 20 s for that Envoy to be ready; shows the end
# of its log and fails otherwise.
await_envoy() {
  local _
  for _ in $(seq 1 200); do
    curl -fs "http://127.0.0.1:$1/ready" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  tail -20 "$2"
  return 1
}

# `demo URL WHAT LOGS` prints how to try the edge at URL, sends the same prompt twice (MISS,
# then HIT) and shows the cache header.
demo() {
  local edge=$1 what=$2 logs=$3
  local body=$DEMO_BODY
  cat <<MSG

holysheep-edge is running: ${what}, mock HolySheep on :${MOCK_PORT:-18000}.
Logs: ${logs}    Stop: Ctrl-C or envoy/stop.sh

Try it (run twice: MISS, then HIT):
  curl -si $edge -H 'authorization: Bearer demo' -d '$body' | grep -i -e x-holysheep -e '^age'

MSG
  for i in 1 2; do
    printf 'request %s: ' "$i"
    curl -si "$edge" -H 'authorization: Bearer demo' -d "$body" | grep -i 'x-holysheep-cache' || true
  done
}
