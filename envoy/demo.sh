#!/usr/bin/env bash
# Sourced by envoy/run.sh and envoy/run-component.sh: `demo URL WHAT LOGS` prints how to try
# the edge at URL, sends the same prompt twice (MISS, then HIT) and shows the cache header.
demo() {
  local edge=$1 what=$2 logs=$3
  local body='{"model":"gpt-4.1","messages":[{"role":"user","content":"Name three sheep breeds."}],"temperature":0}'
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
