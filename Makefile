# The two commands: `make run` (demo on the mock) and `make test` (everything CI runs).
.PHONY: admin native run-native walk sim otel-receiver shells-check size-check size-profile k8s-check oci rules-check run run-cluster run-tiers run-component test check imports-check fuzz-check bench profile floors soak stop setup clean wit-lock fuzz tenant-key docs-check

# What the tests need (`make run` and the other demos install only what they use).
setup:
	envoy/setup.sh test

run:
	envoy/run.sh

run-native:
	HOLYSHEEP_SHELL=native envoy/run.sh

# The native Envoy module (docs/native.md): target/native/libholysheep_edge.so.
native:
	cargo build --profile native --features native --lib

run-cluster:
	envoy/run-cluster.sh

run-tiers:
	envoy/run-cluster.sh tiers

run-component:
	envoy/run-component.sh

wit-lock:
	wit/lock.sh

# The operators' command line (docs/operations.md#the-admin-command).
admin:
	cargo build --release -p holysheep-admin
	@echo target/release/holysheep-admin

# A new tenant key: the token to hand to the tenant (shown once), and the SHA-256 that goes
# into `tenants.<name>.keys_sha256` (docs/tenants.md).
tenant-key:
	@python3 -c 'import hashlib, secrets; t = "hs-" + secrets.token_urlsafe(32); \
	  print("token:      " + t); print("keys_sha256: " + hashlib.sha256(t.encode()).hexdigest())'

# Links, make targets and paths in README.md and docs/ (docs/check.sh); the configurations
# they show are parsed by a unit test in src/core/config/mod.rs.
docs-check:
	docs/check.sh

# Every manifest in deploy/kubernetes/, offline, against the Kubernetes and CRD schemas
# (docs/deploy.md#kubernetes).
k8s-check: setup
	.venv/bin/python deploy/kubernetes/validate.py .venv/bin/envoy target/plugin/holysheep_edge.wasm

# The plugin as a Wasm OCI image (an OCI image layout in target/oci/holysheep-edge, tagged
# with the crate's version), for Istio's WasmPlugin and Envoy Gateway (docs/deploy.md#oci-image).
oci: setup
	python3 deploy/oci/pack.py target/plugin/holysheep_edge.wasm target/oci/holysheep-edge \
	  "$$(cargo pkgid -p holysheep-edge | sed 's/.*[#@]//')"

# The Prometheus scrape configuration and rules in deploy/prometheus/, and the rules' unit
# tests (docs/deploy.md#prometheus).
rules-check: setup
	promtool check config deploy/prometheus/prometheus.yml
	cd deploy/prometheus && promtool test rules holysheep.rules.test.yml

stop:
	envoy/stop.sh

# An OTLP/gRPC receiver on 127.0.0.1:4317 that prints each span, log record and metric point
# Envoy sends as a JSON line (docs/operations.md#opentelemetry); OTLP_ADDR=host:port moves it.
otel-receiver:
	cargo run --quiet -p holysheep-otlp --bin otlp-receiver -- $${OTLP_ADDR:-127.0.0.1:4317}

# The quick level (a minute or two after a first build): format, clippy, the core's unit
# tests, the docs, the module graph and the fuzz targets' types. `make test` runs all of it.
check: docs-check imports-check fuzz-check shells-check
	python3 tools/blocks-check.py
	cargo fmt --all --check
	cargo clippy --quiet --workspace --all-targets -- -D warnings
	cargo test --quiet -p holysheep-edge --lib

# The fleet simulator (src/core/sim/, docs/testing.md#the-fleet-simulator): SEEDS seeds of
# STEPS steps each, or the one seed SEED= (the command a failing seed prints), built for
# speed. `cargo test` runs seeds 1 to 40 of 2000 steps.
SEEDS ?= 1000
STEPS ?= 2000
sim:
	SIM_SEEDS=$(SEEDS) SIM_STEPS=$(STEPS) $(if $(SEED),SIM_SEED=$(SEED)) \
	  cargo test --release --quiet -p holysheep-edge --lib core::sim -- --nocapture

# Clippy on each shell's own build, warnings denied (`make test` does it in tools/suites.sh).
# With the native build, which has no shell, this reports a core item nothing uses
# (src/core/mod.rs, "The face").
shells-check:
	rustup target add wasm32-wasip1 wasm32-wasip2 >/dev/null 2>&1
	cargo clippy --quiet -p holysheep-edge --lib --target wasm32-wasip1 -- -D warnings
	cargo clippy --quiet -p holysheep-edge --lib --target wasm32-wasip2 -- -D warnings
	cargo clippy --quiet -p holysheep-edge --lib --features native -- -D warnings

# No import circle anywhere in the repository's crates, and no arrow up the core's floors
# (tools/imports.py prints each graph's figures).
imports-check:
	python3 tools/imports.py src host-test/src host-test/bench/src host-test/bench/src/bin/bench \
	  host-test/mock/src host-test/otlp/src host-test/render/src host-test/tests/envoy host-test/tests/hosts

# The fuzz targets type-check on stable, so they cannot drift from the core (running them
# needs nightly: `make fuzz`).
fuzz-check:
	cd fuzz && cargo check --quiet --locked --target-dir ../target/fuzz-check

# The plugin and the component stay within tools/size-budget.
size-check: setup
	tools/size-check.sh

# Where the plugin's bytes go: the release build with its function names, through the same
# wasm-opt -Oz as the shipped plugin -> target/size-profile.md.
size-profile:
	CARGO_PROFILE_RELEASE_STRIP=false cargo build --quiet --release --target wasm32-wasip1 --target-dir target/profile
	envoy/wasm-opt.sh target/profile/wasm32-wasip1/release/holysheep_edge.wasm target/profile/plugin.wasm -g
	python3 tools/size_profile.py target/profile/plugin.wasm 25 > target/size-profile.md
	@cat target/size-profile.md

test: setup docs-check imports-check fuzz-check size-check rules-check k8s-check oci
	python3 tools/blocks-check.py
	cargo fmt --all --check
	tools/suites.sh

# The floors are tiny proxy-wasm filters (host-test/bench/floors/) measured beside the plugin;
# the charts need matplotlib, installed into ./.venv here (not for the tests).
floors:
	for f in reply callout; do (cd host-test/bench/floors/$$f && \
	  CARGO_TARGET_DIR=../../../../target/floors cargo build --quiet --release --target wasm32-wasip1) || exit 1; done

# The native hosts run as built for speed (`--profile host`); RUST_LIB_BACKTRACE=0 because
# with RUST_BACKTRACE set, wasmtime captures a backtrace for every store it drops.
bench: setup floors
	RUST_LIB_BACKTRACE=0 cargo run --quiet --profile host -p holysheep-bench --bin bench
	if [ -z "$$BENCH_ONLY" ]; then .venv/bin/pip install --quiet matplotlib==3.9.2 && \
	  .venv/bin/python host-test/bench/bench_charts.py target/bench; fi

# Where the time goes (needs perf): the plugin, built with its function names, and the floors
# in the wasmtime host under `perf record` -> target/bench/profile.md; then the bench with
# Envoy itself under `perf record` (BENCH_PROFILE=1) -> a CPU table in target/bench/results.md.
profile: setup floors
	CARGO_PROFILE_RELEASE_STRIP=false cargo build --quiet --release --target wasm32-wasip1 --target-dir target/profile
	envoy/wasm-opt.sh target/profile/wasm32-wasip1/release/holysheep_edge.wasm target/profile/plugin.wasm -g
	RUST_LIB_BACKTRACE=0 cargo run --quiet --profile host -p holysheep-bench --bin wasm_profile -- \
	  target/profile/plugin.wasm target/floors/wasm32-wasip1/release
	BENCH_PROFILE=1 $(MAKE) --no-print-directory bench

# The walk of one budgeted MISS through the plugin's source files, by function entry, loop
# and return (tools/walk.sh; WALK_BEFORE=<commit> walks that commit's plugin beside this
# one) -> target/walk/walk.md.
walk: setup
	tools/walk.sh $(WALK_BEFORE)

# 10 minutes of mixed traffic; passes when Envoy's RSS stays within 10 % after warm-up
# and no VM crashed (SOAK_SECONDS to change the length). Not in CI.
soak: setup
	RUST_LIB_BACKTRACE=0 cargo run --quiet --profile host -p holysheep-bench --bin soak

# Fuzzing needs the nightly toolchain and cargo-fuzz (kept out of CI). FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 60
fuzz:
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.1 --locked
	cd fuzz && for t in request sse records head peer answers spend float; do \
	  dict=""; [ -f dicts/$$t.dict ] && dict=-dict=dicts/$$t.dict; \
	  cargo +nightly fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) $$dict || exit 1; done

clean:
	rm -rf target .run .venv
