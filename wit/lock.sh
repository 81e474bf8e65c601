#!/usr/bin/env bash
# Writes wit/deps.lock: one line per vendored file, "<sha256>  deps/<package>/<file>".
set -euo pipefail
cd "$(dirname "$0")"
find deps -name '*.wit' | LC_ALL=C sort | xargs sha256sum > deps.lock
