#!/usr/bin/env bash
# wasm-opt.sh IN OUT [FLAGS...]: the plugin as it ships is cargo's release build (this crate
# optimised for speed, its dependencies for size) passed through Binaryen's `wasm-opt -Oz`,
# which takes about 80 KB off without undoing the inlining (Cargo.toml has the numbers).
# Binaryen comes from the npm registry (its own Node.js build, pinned) into .venv/binaryen.
# IN and OUT are relative to the repository root; FLAGS go to wasm-opt (`make profile` keeps
# the function names with -g).
set -euo pipefail
cd "$(dirname "$0")/.."

BINARYEN_VERSION=132.0.0
dir=.venv/binaryen
if [ "$(cat "$dir/version" 2>/dev/null)" != "$BINARYEN_VERSION" ]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  npm install --silent --no-audit --no-fund --prefix "$dir" "binaryen@${BINARYEN_VERSION}" >/dev/null
  echo "$BINARYEN_VERSION" > "$dir/version"
fi

in=$1 out=$2
shift 2
if [ "$out" -nt "$in" ] && [ "$out" -nt "$0" ]; then
  exit 0
fi
mkdir -p "$(dirname "$out")"
# The features rustc's wasm32 targets use; the stripped module does not name them.
# --low-memory-unused: rustc lays the module out stack first (the stack pointer starts at
# 1 MiB and grows down, data above it), so an address below 1 KiB is reached only by a stack
# about to overflow, and a pointer plus a small constant never wraps into it; Binaryen may
# then fold such constants into the load's offset (about 5 KB off, no instruction added).
node "$dir/node_modules/binaryen/bin/wasm-opt" -Oz --low-memory-unused \
  --enable-bulk-memory --enable-bulk-memory-opt --enable-sign-ext --enable-mutable-globals \
  --enable-nontrapping-float-to-int "$@" "$in" -o "$out"
