#!/usr/bin/env bash
# `make size-check`: fails when the plugin or the component has grown past the budget in
# tools/size-budget (bytes). Every worker of every Envoy compiles the plugin at start and
# holds it in memory: growth is a choice made on purpose, by raising the budget in the same
# change (docs/performance.md#sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
while read -r name path budget; do
  case $name in ''|'#'*) continue ;; esac
  if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "size-check: $name's budget '$budget' is not a number of bytes (tools/size-budget)" >&2
    exit 1
  fi
  size=$(stat -c %s "$path")
  if [ "$size" -gt "$budget" ]; then
    echo "size-check: $name is $size bytes, past its budget of $budget (tools/size-budget)" >&2
    status=1
  else
    echo "size-check: $name $size bytes (budget $budget)"
  fi
done < tools/size-budget
exit $status
