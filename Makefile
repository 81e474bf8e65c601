# The two commands: `make run` (demo on the mock) and `make test` (everything CI runs).
.PHONY: run run-component test bench stop setup clean wit-lock

setup:
	envoy/setup.sh

run:
	envoy/run.sh

run-component: setup
	envoy/run-component.sh

wit-lock:
	wit/lock.sh

stop:
	envoy/stop.sh

test: setup
	cargo fmt --all --check
	cargo clippy --quiet --workspace --all-targets -- -D warnings
	cargo clippy --quiet --release --target wasm32-wasip1 -- -D warnings
	cargo clippy --quiet --release --target wasm32-wasip2 -- -D warnings
	cargo test --workspace

bench: setup
	cargo run --quiet --release -p host-test --bin bench

clean:
	rm -rf target .run .venv
