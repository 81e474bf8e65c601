#!/usr/bin/env bash
# Stops the demo's Envoy and mock started by envoy/run.sh.
cd "$(dirname "$0")/.."
for p in envoy mock; do
  if [ -f ".run/$p.pid" ]; then
    kill "$(cat ".run/$p.pid")" 2>/dev/null && echo "stopped $p"
    rm -f ".run/$p.pid"
  fi
done
exit 0
