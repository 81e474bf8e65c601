#!/usr/bin/env python3
"""The crate's module graph from its paths (`use` lines and `crate::`/`super::` paths in
code, tests left out): prints its figures and fails on any import circle, and on an arrow
up the core's floors (the order `src/core/mod.rs` lists after "Floors, bottom-up:") whose
line, or the line above it, carries no `// up:` comment saying why.

usage: tools/imports.py [SRC_DIR...]   (default: src; each a crate's source root)
"""
import os
import re
import sys

PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")
GROUP = re.compile(r"\b(crate|super)((?:::\w+)*)::\{([^}]*)\}")


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def code(text):
    """The file without its unit tests and comments."""
    cut = re.search(r"#\[cfg\(test\)\]\s*mod tests", text)
    if cut:
        text = text[: cut.start()]
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def resolve(here, root, rest, modules):
    base = list(here) if root == "super" else []
    if root == "super":
        base = base[:-1]
    parts = [p for p in rest.split("::") if p]
    while parts and parts[0] == "super":
        base, parts = base[:-1], parts[1:]
    best = None
    for i in range(len(parts) + 1):
        cand = tuple(base + parts[:i])
        if cand in modules:
            best = cand
    return best


def refs_of(text):
    """Each path the code names, with the line it starts on."""
    out = []
    for m in GROUP.finditer(text):
        root, prefix, inner = m.groups()
        line = text.count("\n", 0, m.start())
        for item in inner.split(","):
            item = item.strip().split(" as ")[0].strip()
            if item == "self":
                out.append((root, prefix, line))
            elif item:
                out.append((root, prefix + "::" + item, line))
    for m in PATH.finditer(text):
        out.append((m.group(1), m.group(2), text.count("\n", 0, m.start())))
    return out


def graph(src, lines=None):
    """module -> the modules it uses; with `lines`, also fills lines[(m, t)] with
    (file, line number, raw line) of each use."""
    files = {}
    for dirpath, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(dirpath, n)
                files[module_of(src, p)] = p
    modules = set(files)
    edges = {m: set() for m in modules}
    for m, p in files.items():
        raw = open(p, encoding="utf-8").read()
        text, rows = code(raw), raw.splitlines()
        for root, rest, line in refs_of(text):
            t = resolve(m, root, rest, modules)
            # A module's own children are its to declare; a path into an ancestor's own
            # items (its mod.rs) is an arrow up, counted.
            if t and t != m and t[: len(m)] != m:
                edges[m].add(t)
                if lines is not None:
                    lines.setdefault((m, t), []).append((p, line + 1, rows[line - 1 : line + 1]))
    return edges


def circles(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def floors(src):
    """The core's floors, bottom-up, as src/core/mod.rs lists them."""
    text = open(os.path.join(src, "core", "mod.rs"), encoding="utf-8").read()
    m = re.search(r"Floors, bottom-up:(.*?)\.\s*$", text, re.S | re.M)
    if not m:
        sys.exit("imports: src/core/mod.rs lists no 'Floors, bottom-up:'")
    names = re.sub(r"//!", " ", m.group(1))
    return [n.strip().strip("`") for n in names.split(",")]


def ups(src, edges, lines):
    """Arrows up a floor: (from, to, commented, where); none in a crate without the core."""
    if not os.path.exists(os.path.join(src, "core", "mod.rs")):
        return []
    order = floors(src)
    have = sorted({m[1] for m in edges if len(m) >= 2 and m[0] == "core"})
    missing = [n for n in have if n not in order]
    if missing:
        sys.exit("imports: floors missing from src/core/mod.rs: " + ", ".join(missing))
    pos = {n: i for i, n in enumerate(order)}
    out = []
    for (m, t), uses in sorted(lines.items()):
        if m[:1] != ("core",) or t[:1] != ("core",) or len(m) < 2 or len(t) < 2:
            continue
        if pos[m[1]] < pos[t[1]]:
            for path, n, rows in uses:
                ok = any("// up:" in r for r in rows)
                out.append((m, t, ok, f"{path}:{n}"))
    return out


def main():
    roots = sys.argv[1:] or ["src"]
    sys.exit(max(check(src) for src in roots))


def check(src):
    lines = {}
    edges = graph(src, lines)
    found = circles(edges)
    arrows = sum(len(e) for e in edges.values())
    up = ups(src, edges, lines)
    bare = [u for u in up if not u[2]]
    up_arrows = len({(m, t) for m, t, _, _ in up})
    print(
        f"imports {src}: {len(edges)} modules, {arrows} arrows, {len(found)} circle(s), "
        f"{up_arrows} arrow(s) up a floor, {len(bare)} without '// up:'"
    )
    for c in found:
        print("circle: " + " -> ".join("::".join(m) for m in c))
    for m, t, _, where in bare:
        print(f"up without a reason: {'::'.join(m)} -> {'::'.join(t)} at {where}")
    return 1 if found or bare else 0


if __name__ == "__main__":
    main()
