#!/usr/bin/env python3
"""`make size-profile`: where the plugin's bytes go.

Reads a wasm module that keeps its function names (the release build passed through
`wasm-opt -Oz -g`, as `make size-profile` makes it) and prints, as Markdown, the bytes of
each section, of each module of this crate and each dependency (function bodies summed by
the path their names demangle to), and the largest functions. Serde's derived
deserializers are generic over the reader, so they are named after serde, not after the
type they read: they are counted as `serde (derived)`.
"""

import collections
import re
import sys

SECTIONS = {0: "custom (names: not shipped)", 1: "type", 2: "import", 3: "function", 4: "table",
            5: "memory", 6: "global", 7: "export", 8: "start", 9: "element", 10: "code",
            11: "data", 12: "data count"}


def leb(data, i):
    value, shift = 0, 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def read(path):
    data = open(path, "rb").read()
    if data[:4] != b"\0asm":
        sys.exit(f"{path}: not a wasm module")
    pos, imported, bodies, names, sections = 8, 0, [], {}, collections.Counter()
    while pos < len(data):
        sid = data[pos]
        size, pos = leb(data, pos + 1)
        end = pos + size
        sections[sid] += size
        if sid == 2:
            count, i = leb(data, pos)
            for _ in range(count):
                for _ in range(2):
                    n, i = leb(data, i)
                    i += n
                kind = data[i]
                i += 1
                if kind == 0:
                    _, i = leb(data, i)
                    imported += 1
                elif kind == 1:
                    i += 1
                    flags = data[i]
                    _, i = leb(data, i + 1)
                    if flags & 1:
                        _, i = leb(data, i)
                elif kind == 2:
                    flags = data[i]
                    _, i = leb(data, i + 1)
                    if flags & 1:
                        _, i = leb(data, i)
                elif kind == 3:
                    i += 2
        elif sid == 10:
            count, i = leb(data, pos)
            for _ in range(count):
                n, j = leb(data, i)
                bodies.append(n + (j - i))
                i = j + n
        elif sid == 0:
            n, i = leb(data, pos)
            if data[i:i + n] == b"name":
                i += n
                while i < end:
                    sub = data[i]
                    n, i = leb(data, i + 1)
                    if sub == 1:
                        count, j = leb(data, i)
                        for _ in range(count):
                            index, j = leb(data, j)
                            n2, j = leb(data, j)
                            names[index] = data[j:j + n2].decode("utf-8", "replace")
                            j += n2
                    i += n
        pos = end
    functions = [(size, names.get(imported + k, "?")) for k, size in enumerate(bodies)]
    return sections, functions


def path_of(name):
    """The Rust path a (legacy-mangled) symbol names, `<impl>` paths by their type."""
    parts, s = [], name
    if s.startswith("_ZN"):
        s = s[3:]
        while s and s[0].isdigit():
            digits = re.match(r"\d+", s).group()
            n = int(digits)
            s = s[len(digits):]
            parts.append(s[:n])
            s = s[n:]
    else:
        return [name]
    if parts and parts[0].startswith("_$LT$"):
        inner = parts[0][5:].replace("$RF$", "").replace("mut$u20$", "")
        inner = re.split(r"\$u20\$as\$u20\$|\$LT\$|\$GT\$", inner)[0]
        parts = inner.split("..") + parts[1:]
    return [p for p in parts if not re.fullmatch(r"h[0-9a-f]{16}", p)]


def group(parts):
    if parts[0] == "holysheep_edge":
        return "::".join(parts[:3])
    if parts[0] == "core" and len(parts) > 2 and parts[1] == "marker" and "PhantomData" in parts[2]:
        return "serde (derived)"
    if parts[0] in ("core", "alloc", "std"):
        return "::".join(parts[:3])
    return parts[0]


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    sections, functions = read(path)
    shipped = sum(v for k, v in sections.items() if k != 0)
    print(f"# Size profile of `{path}`\n")
    print(f"{shipped:,} bytes without the name section.\n")
    print("| section | bytes |\n|---|---:|")
    for sid, size in sorted(sections.items(), key=lambda kv: -kv[1]):
        if sid != 0:
            print(f"| {SECTIONS.get(sid, sid)} | {size:,} |")
    groups = collections.Counter()
    for size, name in functions:
        groups[group(path_of(name))] += size
    code = sum(size for size, _ in functions)
    print(f"\n{len(functions):,} functions, {code:,} bytes of code, by path:\n")
    print("| path | bytes | share of code |\n|---|---:|---:|")
    for name, size in groups.most_common(top):
        print(f"| `{name}` | {size:,} | {100 * size / code:.1f} % |")
    print(f"\nThe {top} largest functions:\n")
    print("| function | bytes |\n|---|---:|")
    for size, name in sorted(functions, reverse=True)[:top]:
        print(f"| `{'::'.join(path_of(name))[:110]}` | {size:,} |")


if __name__ == "__main__":
    main()
