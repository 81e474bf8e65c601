#!/usr/bin/env bash
# The suites of `make test`, built once and then run side by side: the Envoy suite (real
# Envoys, the mock and etcd, mostly waiting on them; on the plugin, then on the native
# module) beside clippy (native and both wasm
# targets) and then the rest (the unit tests, the wasmtime hosts suite, the doc tests). Each lane's
# output is printed whole when all have ended, with its time; the run fails when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --no-run --quiet || exit 1
out=target/suites
rm -rf "$out" && mkdir -p "$out"

# Each lane in a process group of its own (`set -m`), all of it stopped when this script is.
set -m
lanes=()
trap 'for lane in "${lanes[@]}"; do kill -- "-$lane" 2>/dev/null; done; exit 130' INT TERM

run() {
    local name=$1
    shift
    (
        local began=$SECONDS
        "$@" </dev/null >"$out/$name.log" 2>&1
        echo "$? $((SECONDS - began))" >"$out/$name.rc"
    ) &
    lanes+=($!)
}

# `--workspace` in every command: the features stay those of the build above, so nothing
# is built again. The second lane starts once the first one's cargo has released the build
# directory's lock (it prints `Running` as it starts the suite; a minute at most), and
# holds it for clippy while the Envoy suite runs.
# The Envoy suite on the plugin, then on the native module (less what
# host-test/tests/envoy/native-skips.txt leaves out, and why).
# Each shell's run counts: the second runs whatever the first did.
native_skips=$(sed 's/#.*//' host-test/tests/envoy/native-skips.txt | awk 'NF {printf "--skip %s ", $1}')
# shellcheck disable=SC2086 # one argument per word of the list
run envoy bash -c 'cargo test --workspace --test envoy; plugin=$?
    HOLYSHEEP_TEST_SHELL=native cargo test --workspace --test envoy -- "$@"; native=$?
    exit $((plugin | native))' envoy $native_skips
for _ in $(seq 300); do
    grep -q "Running" "$out/envoy.log" 2>/dev/null || [ -e "$out/envoy.rc" ] && break
    sleep 0.2
done
# The second lane yields the CPU to the first (`nice`): it has time to spare.
run rest nice -n 10 bash -c 'set -e
    cargo clippy --quiet --workspace --all-targets -- -D warnings
    for wasm in wasm32-wasip1 wasm32-wasip2; do
        cargo clippy --quiet --release --target $wasm -- -D warnings
    done
    cargo test --workspace --lib --bins
    cargo test --workspace --test hosts
    cargo test --workspace --doc'
wait

failed=0
for name in rest envoy; do
    cat "$out/$name.log"
    read -r rc took <"$out/$name.rc"
    echo "suite $name: exit $rc in ${took} s"
    [ "$rc" = 0 ] || failed=1
done
exit $failed
