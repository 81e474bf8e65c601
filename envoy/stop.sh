#!/usr/bin/env bash
# Stops what envoy/run.sh or envoy/run-component.sh started.
cd "$(dirname "$0")/.."
for p in envoy component mock; do
  if [ -f ".run/$p.pid" ]; then
    kill "$(cat ".run/$p.pid")" 2>/dev/null && echo "stopped $p"
    rm -f ".run/$p.pid"
  fi
done
exit 0
