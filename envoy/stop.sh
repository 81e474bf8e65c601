#!/usr/bin/env bash
# Stops what envoy/run.sh, envoy/run-component.sh or envoy/run-cluster.sh (either mode, and
# its etcd) started.
cd "$(dirname "$0")/.."
for p in envoy component mock fleet-0 fleet-1 fleet-2 edge-0 edge-1 edge-2 etcd; do
  if [ -f ".run/$p.pid" ]; then
    kill "$(cat ".run/$p.pid")" 2>/dev/null && echo "stopped $p"
    rm -f ".run/$p.pid"
  fi
done
exit 0
