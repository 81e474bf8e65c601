#!/usr/bin/env bash
# Three Envoys on one machine as one fleet (envoy/fleet.yaml.tmpl) in front of the mock
# HolySheep: a burst of identical prompts spread over the three public listeners makes
# one upstream call. Ctrl-C (or envoy/stop.sh) stops everything.
#
# Node i (0..2): public :1001i, owner :1002i, admin :991i. Mock :18000.
set -euo pipefail
cd "$(dirname "$0")/.."
. envoy/demo.sh
prepare

CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600}}'}
MOCK_PORT=${MOCK_PORT:-18000}
# The fleet's shared secret for internal calls: every node must have the same one.
export HOLYSHEEP_PEER_SECRET=${HOLYSHEEP_PEER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}

start_mock "127.0.0.1:$MOCK_PORT"
for i in 0 1 2; do
  # The public listener's filter gets CONFIG with "role": "forward", the owner's CONFIG with
  # the ring of owners for fleet-wide limits; each node is named by its owner listener.
  target/debug/envoy-render fleet ".run/fleet-$i.yaml" --config "$CONFIG" --admin-port "991$i" \
    --public-port "1001$i" --owner-port "1002$i" --owner-ports 10020,10021,10022 --mock-port "$MOCK_PORT"
  .venv/bin/envoy -c ".run/fleet-$i.yaml" --concurrency 2 --disable-hot-restart -l info \
    > ".run/fleet-$i.log" 2>&1 &
  echo $! > ".run/fleet-$i.pid"
done
trap 'envoy/stop.sh' INT TERM

for i in 0 1 2; do
  await_envoy "991$i" ".run/fleet-$i.log"
done
# Each node's ring must see every owner healthy (the health check runs every second).
for i in 0 1 2; do
  for _ in $(seq 1 100); do
    [ "$(curl -s "http://127.0.0.1:991$i/clusters" | grep -c '^owners::.*::health_flags::healthy$')" = 3 ] && break
    sleep 0.1
  done
done
sleep 1.2  # one health-check interval more: every worker's ring has the owners

calls() {
  local n=0 i v
  for i in 0 1 2; do
    v=$(curl -s "http://127.0.0.1:991$i/stats?filter=upstream_calls" | awk -F': ' '{s+=$2} END {print s+0}')
    n=$((n + v))
  done
  echo "$n"
}

body=$DEMO_BODY
cat <<MSG

holysheep-edge fleet is running: public listeners :10010 :10011 :10012, owners :10020-:10022,
admin :9910-:9912, mock HolySheep on :$MOCK_PORT.
Logs: .run/fleet-{0,1,2}.log .run/mock.log    Stop: Ctrl-C or envoy/stop.sh

A burst of 30 identical prompts, 10 on each node's public listener:
MSG
before=$(calls)
for n in $(seq 0 29); do
  curl -s -o /dev/null -w '%{http_code} %header{x-holysheep-cache} from owner %header{x-holysheep-owner}\n' \
    "http://127.0.0.1:1001$((n % 3))/v1/chat/completions" -H 'authorization: Bearer demo' -d "$body" &
done | sort | uniq -c
echo "upstream calls for the burst, over the whole fleet: $(( $(calls) - before ))"
echo
echo "Try it on any node (a HIT everywhere now):"
echo "  curl -si http://127.0.0.1:10011/v1/chat/completions -H 'authorization: Bearer demo' -d '$body' | grep -i x-holysheep"
wait "$(cat .run/fleet-0.pid)"
