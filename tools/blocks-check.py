#!/usr/bin/env python3
"""`make check`: the configuration blocks other files copy from envoy/production.yaml are
production.yaml's, word for word.

A block is marked `# NAME: begin` ... `# NAME: end`, at any indentation. production.yaml is
the one the Envoy tests start for real (with these blocks); the demo templates and the
Kubernetes fleet carry copies, which must not drift.
"""
import os
import re
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COPIES = {
    "envoy/local.yaml.tmpl": ["stats-tags"],
    "envoy/fleet.yaml.tmpl": ["stats-tags"],
    "envoy/edge.yaml.tmpl": ["stats-tags"],
    "deploy/kubernetes/fleet/holysheep-edge.yaml":
        ["stats-tags", "otel-stats", "otel-access-log", "tracing", "otel-cluster"],
}


def blocks(text, name):
    """Each `# NAME: begin` ... `# NAME: end` block of `text`, dedented."""
    found = re.findall(r"^[ ]*# %s: begin\n(.*?)^[ ]*# %s: end$" % (name, name), text, re.S | re.M)
    return [textwrap.dedent(body) for body in found]


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def main():
    production = read("envoy/production.yaml")
    failures = 0
    for path, names in COPIES.items():
        text = read(path)
        for name in names:
            [shipped] = blocks(production, name)
            copies = blocks(text, name)
            if not copies or any(c != shipped for c in copies):
                print(f"blocks-check: {path}'s '{name}' block is not envoy/production.yaml's", file=sys.stderr)
                failures += 1
    checked = sum(len(n) for n in COPIES.values())
    print(f"blocks-check: {checked} copied blocks, {failures} drifted")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
