#!/usr/bin/env bash
# `envoy/run-cluster.sh`: three Envoys on one machine as one fleet (envoy/fleet.yaml.tmpl)
# in front of the mock HolySheep. `envoy/run-cluster.sh tiers`: two tiers, three edge nodes
# that only forward (envoy/edge.yaml.tmpl) in front of two shields (fleet.yaml.tmpl). Either
# way a burst of identical prompts spread over the public listeners makes one upstream
# call, and a repeat is answered on the node it reaches. Ctrl-C (or envoy/stop.sh) stops
# everything.
#
# The nodes speak mutual TLS to each other's owner listeners (envoy/fleet-certs.sh makes a
# test CA in .run/fleet-tls). Fleet node i: public :1001i, owner :1002i, admin :991i. Edge node j: public :1003j, admin
# :993j. Mock :18000. With Debian's etcd installed (apt-get install etcd-server), one etcd
# member on :12379 keeps tenants' spend (budget_store), its data in .run/etcd.
set -euo pipefail
cd "$(dirname "$0")/.."
. envoy/demo.sh
prepare

MODE=${1:-one}
ETCD_PORT=${ETCD_PORT:-12379}
if command -v etcd >/dev/null; then
  CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600},"budget_store":{"cluster":"etcd"}}'}
else
  CONFIG=${HOLYSHEEP_CONFIG:-'{"cache":{"ttl_seconds":600}}'}
fi
MOCK_PORT=${MOCK_PORT:-18000}
# The fleet's shared secret for internal calls: every node must have the same one.
export HOLYSHEEP_PEER_SECRET=${HOLYSHEEP_PEER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
case $MODE in
  one) nodes="0 1 2" edges="" ;;
  tiers) nodes="0 1" edges="0 1 2" ;;
  *) echo "usage: envoy/run-cluster.sh [one|tiers]" >&2; exit 2 ;;
esac
owner_ports=$(for i in $nodes; do printf '1002%s,' "$i"; done)
owner_ports=${owner_ports%,}

# `start NAME`: Envoy on .run/NAME.yaml in the background.
start() {
  .venv/bin/envoy -c ".run/$1.yaml" --concurrency 2 --disable-hot-restart -l info > ".run/$1.log" 2>&1 &
  echo $! > ".run/$1.pid"
}

start_mock "127.0.0.1:$MOCK_PORT"
if command -v etcd >/dev/null; then
  etcd --name demo --data-dir .run/etcd --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "demo=http://127.0.0.1:$((ETCD_PORT + 1))" > .run/etcd.log 2>&1 &
  echo $! > .run/etcd.pid
fi
# The spend store's cluster, added to each fleet node's.
etcd_cluster() {
  command -v etcd >/dev/null || return 0
  cat <<YAML
  - name: etcd
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: etcd
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $ETCD_PORT}}}}]}]
YAML
}
# Mutual TLS between the nodes: a test CA and the nodes' certificate (made again when they
# are about to expire).
envoy/fleet-certs.sh .run/fleet-tls
for i in $nodes; do
  # The public listener's filter gets CONFIG with "role": "forward", the owner's CONFIG with
  # the ring of owners for fleet-wide limits, serving only the fleet's nodes; each node is
  # named by its owner listener.
  target/debug/envoy-render fleet ".run/fleet-$i.yaml" --config "$CONFIG" --admin-port "991$i" \
    --public-port "1001$i" --owner-port "1002$i" --owner-ports "$owner_ports" --mock-port "$MOCK_PORT" \
    --tls-dir .run/fleet-tls
  etcd_cluster >> ".run/fleet-$i.yaml"
  start "fleet-$i"
done
for j in $edges; do
  target/debug/envoy-render edge ".run/edge-$j.yaml" --config "$CONFIG" --admin-port "993$j" \
    --public-port "1003$j" --owner-ports "$owner_ports" --tls-dir .run/fleet-tls
  start "edge-$j"
done
trap 'envoy/stop.sh' INT TERM

admins="$(for i in $nodes; do echo "991$i"; done) $(for j in $edges; do echo "993$j"; done)"
for a in $admins; do
  log=.run/fleet-${a#991}.log
  [ "${a#993}" != "$a" ] && log=.run/edge-${a#993}.log
  await_envoy "$a" "$log"
done
# Each node's ring must see every owner healthy (the health check runs every second).
owners=$(echo "$nodes" | wc -w)
for a in $admins; do
  for _ in $(seq 1 100); do
    [ "$(curl -s "http://127.0.0.1:$a/clusters" | grep -c '^owners::.*::health_flags::healthy$')" = "$owners" ] && break
    sleep 0.1
  done
done
sleep 1.2  # one health-check interval more: every worker's ring has the owners

calls() {
  local n=0 i v
  for i in $nodes; do
    v=$(curl -s "http://127.0.0.1:991$i/stats?filter=upstream_calls" | awk -F': ' '{s+=$2} END {print s+0}')
    n=$((n + v))
  done
  echo "$n"
}

if [ "$MODE" = tiers ]; then
  publics="10030 10031 10032"
  what="edge nodes' public listeners :10030-:10032 (admin :9930-:9932) in front of shields' owners
:10020-:10021 (admin :9910-:9911)"
  logs=".run/edge-{0,1,2}.log .run/fleet-{0,1}.log .run/mock.log"
else
  publics="10010 10011 10012"
  what="public listeners :10010 :10011 :10012, owners :10020-:10022, admin :9910-:9912"
  logs=".run/fleet-{0,1,2}.log .run/mock.log"
fi
[ -f .run/etcd.pid ] && logs="$logs .run/etcd.log" && what="$what, etcd :$ETCD_PORT (budget_store)"
set -- $publics
body=$DEMO_BODY
cat <<MSG

holysheep-edge fleet is running: $what, mock HolySheep on :$MOCK_PORT.
Logs: $logs    Stop: Ctrl-C or envoy/stop.sh

A burst of 30 identical prompts, 10 on each public listener:
MSG
before=$(calls)
for n in $(seq 0 29); do
  port=$(( $1 + n % 3 ))
  curl -s -o /dev/null -w '%{http_code} %header{x-holysheep-cache} tier %header{x-holysheep-tier}\n' \
    "http://127.0.0.1:$port/v1/chat/completions" -H 'authorization: Bearer demo' -d "$body" &
done | sort | uniq -c
echo "upstream calls for the burst, over the whole fleet: $(( $(calls) - before ))"
echo
echo "The same prompt once more on each public listener: answered there, from its near copy."
for port in $publics; do
  curl -s -o /dev/null -w ":$port %{http_code} %header{x-holysheep-cache} tier %header{x-holysheep-tier}\n" \
    "http://127.0.0.1:$port/v1/chat/completions" -H 'authorization: Bearer demo' -d "$body"
done
echo
echo "Try it on any public listener:"
echo "  curl -si http://127.0.0.1:$2/v1/chat/completions -H 'authorization: Bearer demo' -d '$body' | grep -i x-holysheep"
wait "$(cat .run/mock.pid)"
