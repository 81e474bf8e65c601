#!/usr/bin/env python3
"""`make oci`: the plugin as a Wasm OCI image, in an OCI image layout directory.

    deploy/oci/pack.py WASM OUT_DIR TAG

The image is the layout Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy pull
(the "compat" variant of Istio's Wasm image formats): an OCI image manifest whose one layer
is a gzipped tar holding `plugin.wasm`. It is built reproducibly (fixed times, owners and
modes), so the same plugin always gives the same digests. Prints the manifest's digest and
the plugin's sha256 (the `sha256` Envoy's remote loading checks).
"""
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile


def blob(out, data):
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(out, "blobs", "sha256", digest)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}


def layer_tar(wasm):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("plugin.wasm")
        info.size, info.mode, info.mtime, info.uid, info.gid = len(wasm), 0o444, 0, 0, 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    return buf.getvalue()


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: deploy/oci/pack.py WASM OUT_DIR TAG")
    wasm_path, out, tag = sys.argv[1:]
    with open(wasm_path, "rb") as f:
        wasm = f.read()
    os.makedirs(out, exist_ok=True)
    tar = layer_tar(wasm)
    gz = gzip.compress(tar, mtime=0)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob(out, gz)}
    config = {
        "architecture": "wasm",
        "os": "wasi",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
    }
    config_desc = {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        **blob(out, json.dumps(config, sort_keys=True, separators=(",", ":")).encode()),
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer],
        "annotations": {"org.opencontainers.image.title": "holysheep-edge"},
    }
    manifest_desc = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **blob(out, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }
    with open(os.path.join(out, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [manifest_desc]}, f)
    print(f"manifest {manifest_desc['digest']}")
    print(f"plugin sha256:{hashlib.sha256(wasm).hexdigest()}")


if __name__ == "__main__":
    main()
