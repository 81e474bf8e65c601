#!/usr/bin/env bash
# walk.sh [COMMIT]: the walk of one budgeted MISS through the plugin's source files
# (host-test/bench/src/bin/walk.rs) for this tree's plugin and, given a COMMIT, for that
# commit's beside it, in one table -> target/walk/walk.md. Each plugin is a debug build
# (nothing inlined away) instrumented by Binaryen's --log-execution.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/walk
mkdir -p "$out"
opt=.venv/binaryen/node_modules/binaryen/bin/wasm-opt
[ -x "$opt" ] || envoy/wasm-opt.sh /dev/null /dev/null 2>/dev/null || true
instrument() { # IN OUT
  node "$opt" --log-execution -g --enable-bulk-memory --enable-bulk-memory-opt --enable-sign-ext \
    --enable-mutable-globals --enable-nontrapping-float-to-int "$1" -o "$2"
}
cargo build --quiet --target wasm32-wasip1 --target-dir "$out/target"
instrument "$out/target/wasm32-wasip1/debug/holysheep_edge.wasm" "$out/now.wasm"
builds=("now=$out/now.wasm")
srcs=(src)
if [ -n "${1:-}" ]; then
  tree="$out/tree-$1"
  [ -d "$tree" ] || git worktree add --detach "$tree" "$1" >/dev/null
  [ -f "$out/before.wasm" ] || (cd "$tree" && cargo build --quiet --target wasm32-wasip1 --target-dir ../target-before)
  instrument "$out/target-before/wasm32-wasip1/debug/holysheep_edge.wasm" "$out/before.wasm"
fi
RUST_LIB_BACKTRACE=0 cargo run --quiet --profile host -p holysheep-bench --bin walk -- --src src "${builds[@]}" \
  | tee "$out/walk.md"
if [ -n "${1:-}" ]; then
  RUST_LIB_BACKTRACE=0 cargo run --quiet --profile host -p holysheep-bench --bin walk -- \
    --src "$out/tree-$1/src" "before=$out/before.wasm" | tee -a "$out/walk.md"
fi
