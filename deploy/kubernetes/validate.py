#!/usr/bin/env python3
"""Validates every manifest under deploy/kubernetes/ offline, as `make test` runs it:

    .venv/bin/python deploy/kubernetes/validate.py ENVOY WASM

- Kubernetes' own kinds against the Kubernetes 1.31 OpenAPI schemas that the
  kubernetes-validate package carries (strict: an unknown field is an error);
- Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy against the openAPIV3Schema of
  their CRDs, vendored in schemas/ (SOURCE.md says from where), unknown fields refused as
  the API server's strict field validation does (their CEL rules are not evaluated);
- the Envoy configuration the fleet's ConfigMap holds, with `envoy --mode validate` (its
  blocks copied from envoy/production.yaml are checked by tools/blocks-check.py).

Each manifest is also validated once more with a field no schema has: that must fail,
so a check that accepts anything cannot pass.
"""
import copy
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
K8S_VERSION = "1.31.0"


def strict(schema):
    """The schema with unknown properties refused wherever it lists the known ones."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_schemas():
    """(apiVersion, kind) -> the strict schema of that version's custom resource."""
    found = {}
    for path in glob.glob(os.path.join(HERE, "schemas", "*-crd.yaml")):
        with open(path) as f:
            crd = yaml.safe_load(f)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            # apiVersion, kind and metadata are the API server's to check.
            schema.setdefault("properties", {}).update(
                {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}})
            found[(f"{group}/{version['name']}", kind)] = schema
    return found


def validate(doc, crds):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in crds:
        jsonschema.validate(doc, crds[key])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def envoy_validates(doc, envoy, wasm):
    config = doc["data"]["envoy.yaml"].replace("/etc/holysheep/holysheep_edge.wasm", wasm)
    # The fleet's certificates, as the holysheep-fleet-tls Secret would mount them: a test
    # CA's (envoy/fleet-certs.sh), for Envoy to load.
    tls = tempfile.mkdtemp()
    subprocess.run([os.path.join(HERE, "..", "..", "envoy", "fleet-certs.sh"), tls], check=True)
    for name, made in [("tls.crt", "node.pem"), ("tls.key", "node-key.pem"), ("ca.crt", "ca.pem")]:
        os.replace(os.path.join(tls, made), os.path.join(tls, name))
    config = config.replace("/etc/holysheep-tls/", tls + "/")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config)
    try:
        out = subprocess.run([envoy, "--mode", "validate", "-c", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
        shutil.rmtree(tls, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"the fleet's Envoy configuration does not validate:\n{out.stderr[-2000:]}")


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: deploy/kubernetes/validate.py ENVOY WASM")
    envoy, wasm = sys.argv[1:]
    crds = crd_schemas()
    checked = 0
    for path in sorted(glob.glob(os.path.join(HERE, "*", "*.yaml"))):
        if os.path.basename(os.path.dirname(path)) == "schemas":
            continue
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            name = f"{os.path.relpath(path, HERE)}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            try:
                validate(doc, crds)
            except Exception as e:  # noqa: BLE001 - every validator's own error type
                raise SystemExit(f"{name} does not validate: {e}")
            bogus = copy.deepcopy(doc)
            bogus.setdefault("spec", {})["holysheepNoSuchField"] = True
            if doc.get("kind") == "ConfigMap":
                bogus = {**doc, "holysheepNoSuchField": True}
            try:
                validate(bogus, crds)
            except Exception:  # noqa: BLE001
                pass
            else:
                raise SystemExit(f"{name}: a field no schema has was accepted: the check checks nothing")
            if doc.get("kind") == "ConfigMap" and "envoy.yaml" in doc.get("data", {}):
                envoy_validates(doc, envoy, wasm)
            checked += 1
            print(f"valid: {name}")
    print(f"{checked} manifests valid (Kubernetes {K8S_VERSION}; {len(crds)} custom resource versions)")


if __name__ == "__main__":
    main()
