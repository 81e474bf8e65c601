#!/usr/bin/env bash
# docs/check.sh [OUT_DIR]: mechanical checks of README.md, CHANGELOG.md and docs/**/*.md.
#
#   a. every relative link points to an existing file, and to an existing heading where it
#      names an anchor in a Markdown file;
#   b. every `make X` in a ```sh block names a target of the Makefile (read now);
#   c. every repository path in a ```sh block exists (build outputs under target/ and
#      .venv/, and absolute paths, are not checked);
#   d. every ```json block is a JSON object; each is written to OUT_DIR/json/ for the
#      plugin's configuration parser;
#   e. every ```yaml block that is a whole Envoy bootstrap is written to OUT_DIR/yaml/ for
#      `envoy --mode validate`;
#   f. every code fence names its language (sh, json, jsonc, yaml or text);
#   g. every `cargo ... -p PKG` in a ```sh block names a workspace package, and its
#      `--test` and `--bin` targets exist.
#
# OUT_DIR defaults to target/docs-check/ (relative to the repository root). It also gets
# MANIFEST, one line per extracted file: "<file> <source>:<line>". Exits 1 on any failure.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-target/docs-check}"
case "$out" in /*) ;; *) out="$root/$out" ;; esac
exec python3 - "$root" "$out" <<'PY'
import json, os, re, sys, unicodedata

root, out = sys.argv[1], sys.argv[2]
os.chdir(root)
failures = []

def fail(where, why):
    failures.append(f"{where}: {why}")

pages = ["README.md", "CHANGELOG.md"]
for d, _, files in os.walk("docs"):
    pages += sorted(os.path.join(d, f) for f in files if f.endswith(".md"))

FENCE = re.compile(r"^(\s*)```(.*)$")
LANGS = {"sh", "json", "jsonc", "yaml", "text"}

def blocks(path):
    """(lang, first line number, text) of each fenced block, and the prose lines."""
    found, prose, lang, start, buf, indent = [], [], None, 0, [], ""
    for n, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, buf, indent = m.group(2).strip(), n, [], m.group(1)
        elif lang is not None and m and not m.group(2).strip():
            found.append((lang, start, "\n".join(buf) + "\n"))
            lang = None
        elif lang is not None:
            buf.append(line[len(indent):] if line.startswith(indent) else line)
        else:
            prose.append((n, line))
    if lang is not None:
        fail(f"{path}:{start}", "code fence never closed")
    return found, prose

def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = s.replace("`", "").replace("*", "")
    s = "".join(c for c in s if c in " -_" or unicodedata.category(c)[0] in "LN")
    return s.replace(" ", "-")

anchors_cache = {}
def anchors(path):
    if path not in anchors_cache:
        seen, result = {}, set()
        _, prose = blocks(path)
        for _, line in prose:
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(1))
                k = seen.get(base, 0)
                result.add(base if k == 0 else f"{base}-{k}")
                seen[base] = k + 1
        anchors_cache[path] = result
    return anchors_cache[path]

# Makefile targets, read now: "name:" at the start of a line (not ":="), and .PHONY names.
targets = set()
for line in open("Makefile", encoding="utf-8"):
    m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
    if m:
        targets.update(m.group(1).split())
    if line.startswith(".PHONY:"):
        targets.update(line.split(":", 1)[1].split())
targets.discard(".PHONY")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:\.ci|docs|envoy|fuzz|host-test|src|wit)/[\w./-]*|[\w-]+\.(?:sh|yaml|tmpl|toml|py))(?![\w/])")

def workspace_packages():
    """Each workspace package's name -> its integration tests and binaries, from the tree."""
    found = {}
    for d, _, files in os.walk("."):
        if "Cargo.toml" not in files or "/target" in d or "/." in d[1:] or d.startswith("./fuzz"):
            continue
        toml = open(os.path.join(d, "Cargo.toml"), encoding="utf-8").read()
        m = re.search(r'^\[package\][^\[]*?^name\s*=\s*"([^"]+)"', toml, re.M | re.S)
        if not m:
            continue
        tests = set()
        tdir = os.path.join(d, "tests")
        if os.path.isdir(tdir):
            for e in os.listdir(tdir):
                if e.endswith(".rs"):
                    tests.add(e[:-3])
                elif os.path.exists(os.path.join(tdir, e, "main.rs")):
                    tests.add(e)
        bins = set(re.findall(r'^\[\[bin\]\][^\[]*?^name\s*=\s*"([^"]+)"', toml, re.M | re.S))
        bdir = os.path.join(d, "src", "bin")
        if os.path.isdir(bdir):
            bins |= {e[:-3] for e in os.listdir(bdir) if e.endswith(".rs")}
        if os.path.exists(os.path.join(d, "src", "main.rs")):
            bins.add(m.group(1))
        found[m.group(1)] = {"tests": tests, "bin": bins}
    return found

packages = workspace_packages()

os.makedirs(os.path.join(out, "json"), exist_ok=True)
os.makedirs(os.path.join(out, "yaml"), exist_ok=True)
for sub in ("json", "yaml"):
    for f in os.listdir(os.path.join(out, sub)):
        os.remove(os.path.join(out, sub, f))
manifest, counts = [], {"json": 0, "yaml": 0}

for page in pages:
    found, prose = blocks(page)
    here = os.path.dirname(page)
    # (a) links, outside code (inline code spans removed first).
    for n, line in prose:
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(here, file)) if file else page
            if not os.path.exists(dest):
                fail(f"{page}:{n}", f"link to missing {target}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                fail(f"{page}:{n}", f"link to missing anchor #{anchor} in {dest}")
    name = page.replace("/", "_").removesuffix(".md")
    for i, (lang, start, text) in enumerate(found, 1):
        where = f"{page}:{start}"
        # (f) every fence names its language.
        if lang not in LANGS:
            fail(where, f"code fence language {lang!r} is not one of {sorted(LANGS)}")
        if lang == "sh":
            for cmd in re.findall(r"(?:^|[;&|(]\s*|\s)make\s+([A-Za-z0-9_.-]+)", text):
                if cmd not in targets:
                    fail(where, f"make {cmd}: no such Makefile target")
            for p in PATH.findall(text):
                p = p.rstrip(".")
                if not os.path.exists(p) and not os.path.exists(os.path.join(here, p)):
                    fail(where, f"{p}: no such file in the repository")
            # (g) every `cargo ... -p PKG [--test T] [--bin B]` names a package and target that exist.
            for line in text.replace("\\\n", " ").splitlines():
                if "cargo " not in line:
                    continue
                words = line.split()
                pkg = words[words.index("-p") + 1] if "-p" in words[:-1] else None
                if pkg is None:
                    continue
                if pkg not in packages:
                    fail(where, f"cargo -p {pkg}: no such package in the workspace")
                    continue
                for flag, kind in (("--test", "tests"), ("--bin", "bin")):
                    if flag in words[:-1]:
                        t = words[words.index(flag) + 1]
                        if t not in packages[pkg][kind]:
                            fail(where, f"cargo -p {pkg} {flag} {t}: no such target")
        elif lang == "json":
            try:
                value = json.loads(text)
            except ValueError as e:
                fail(where, f"json block does not parse: {e}")
                continue
            if not isinstance(value, dict):
                fail(where, "json block is not an object (a plugin configuration)")
                continue
            counts["json"] += 1
            f = f"{name}-{i:02}.json"
            open(os.path.join(out, "json", f), "w", encoding="utf-8").write(text)
            manifest.append(f"json/{f} {where}")
        elif lang == "yaml" and re.search(r"^static_resources:", text, re.M):
            counts["yaml"] += 1
            f = f"{name}-{i:02}.yaml"
            open(os.path.join(out, "yaml", f), "w", encoding="utf-8").write(text)
            manifest.append(f"yaml/{f} {where}")

open(os.path.join(out, "MANIFEST"), "w", encoding="utf-8").write("\n".join(manifest) + "\n")
for f in failures:
    print(f"docs/check.sh: {f}", file=sys.stderr)
print(f"docs/check.sh: {len(pages)} pages, {counts['json']} json and {counts['yaml']} yaml blocks "
      f"written to {out}, {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
PY
