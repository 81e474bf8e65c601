#!/usr/bin/env python3
"""The crate's module graph from its paths (`use` lines and `crate::`/`super::` paths in
code, tests left out): prints its figures and fails on any import circle.

usage: tools/imports.py [SRC_DIR]   (default: src)
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


def graph(src):
    files = {}
    for dirpath, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(dirpath, n)
                files[module_of(src, p)] = p
    modules = set(files)
    edges = {m: set() for m in modules}
    for m, p in files.items():
        text = code(open(p, encoding="utf-8").read())
        refs = []
        for root, prefix, inner in GROUP.findall(text):
            for item in inner.split(","):
                item = item.strip().split(" as ")[0].strip()
                if item and item != "self":
                    refs.append((root, prefix + "::" + item))
                elif item == "self":
                    refs.append((root, prefix))
        refs += PATH.findall(text)
        for root, rest in refs:
            t = resolve(m, root, rest, modules)
            # A module's own children are its to declare; a path into an ancestor's own
            # items (its mod.rs) is an arrow up, counted.
            if t and t != m and t[: len(m)] != m:
                edges[m].add(t)
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


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "src"
    edges = graph(src)
    found = circles(edges)
    arrows = sum(len(e) for e in edges.values())
    print(f"imports: {len(edges)} modules, {arrows} arrows, {len(found)} circle(s)")
    for c in found:
        print("circle: " + " -> ".join("::".join(m) for m in c))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
