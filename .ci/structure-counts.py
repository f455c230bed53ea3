#!/usr/bin/env python3
"""The workspace's shape in numbers: files over 650 lines, functions over 90,
public items, and the integration tests that start the binary.

    python3 .ci/structure-counts.py [--list] [ROOT]

Sources are every `.rs` file of the workspace's crates (`src/`, `crates/*/src/`
but the tests' own `crates/testkit`;
before the workspace, `campaign/src/` too), tests excluded: files named `tests.rs` or under a `tests/`
directory, and `#[cfg(test)]` modules (their lines are not counted and their
functions not measured). A file's length is its lines outside such modules.
A function's length runs from the line of `fn` to its closing brace.

Public items named only inside their crate: the `pub` items (not
`pub(crate)` and the like, not `pub use` or `pub mod`) of a library crate
(`crates/*/` with a `src/lib.rs`) whose name appears in no code outside that
crate's directory (other crates, the root package's `src/`, `tests/`,
`examples/`, `bench/`, `fuzz/`); comments and strings do not count. A name
used elsewhere for something else keeps an item in (the count is a floor).
The binary crates' `pub` items (`src/`, `crates/campaign/`) are listed apart:
no other crate can name them.

Tests that start the binary: test functions in `tests/*.rs` (the workspace's
integration tests) whose body, or a helper function of the same file that
the body calls, starts the proxy as a process (`Proxy::start`,
`Proxy::start_with_env`, `Proxy::spawn`, `.binary()`, `run_to_exit`,
`CARGO_BIN_EXE_idemproxy`); a scenario of `on_every_backend!` counts three times.
"""

import os
import re
import sys

FILE_LIMIT = 650
FN_LIMIT = 90


def strip_literals(text):
    """The text with comments, strings and char literals blanked (newlines kept),
    so that braces can be counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i:i + 12]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'(b?r)(#*)"', text[i:])
            hashes = m.group(2)
            end = text.find('"' + hashes, i + len(m.group(0)))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and (i == 0 or not text[i - 1].isalnum())):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\.|\\x[0-9a-fA-F]{2}|\\u\{[0-9a-fA-F]+\}|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime or label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def closing(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def test_spans(code):
    """(start, end) offsets of `#[cfg(test)]` modules."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code):
        spans.append((m.start(), closing(code, m.end() - 1)))
    return spans


def line_of(code, offset):
    return code.count("\n", 0, offset) + 1


def functions(code, spans):
    """(name, first line, lines) of every function with a body outside test modules."""
    found = []
    for m in re.finditer(r"\bfn\s+(\w+)", code):
        if any(a <= m.start() <= b for a, b in spans):
            continue
        # The body's brace: the first `{` or `;` at nesting 0 of () [] <>-free scan.
        depth, j = 0, m.end()
        while j < len(code):
            ch = code[j]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch == ";":
                j = -1
                break
            elif depth == 0 and ch == "{":
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        end = closing(code, j)
        first, last = line_of(code, m.start()), line_of(code, end)
        found.append((m.group(1), first, last - first + 1))
    return found


def is_test_file(path):
    parts = path.split(os.sep)
    return os.path.basename(path) == "tests.rs" or "tests" in parts[:-1]


def crate_sources(root):
    dirs = [os.path.join(root, "src"), os.path.join(root, "campaign", "src")]
    crates = os.path.join(root, "crates")
    if os.path.isdir(crates):
        # The test kit is the tests' own code (real servers for them), not a crate's source.
        dirs += [os.path.join(crates, c, "src") for c in sorted(os.listdir(crates)) if c != "testkit"]
    for d in dirs:
        for base, _, files in os.walk(d):
            for f in sorted(files):
                if f.endswith(".rs"):
                    path = os.path.join(base, f)
                    if not is_test_file(os.path.relpath(path, root)):
                        yield path


PUB = re.compile(r"^\s*pub\s+(?:(?:async|const|unsafe|extern\s+\"C\")\s+)*(fn|struct|enum|trait|type|const|static|mod|use)\b", re.M)
PUB_CRATE = re.compile(r"^\s*pub\((crate|super|in [^)]*)\)\s", re.M)

STARTS = re.compile(r"Proxy::(start|start_with_env|spawn)\b|\.binary\(\)|CARGO_BIN_EXE_idemproxy\b|\brun_to_exit\(")


def binary_tests(root):
    """(test cases, those starting the binary). A scenario declared with
    `on_every_backend!` is a test case per backend (three)."""
    tests_dir = os.path.join(root, "tests")
    total = starting = 0
    for f in sorted(os.listdir(tests_dir)):
        if not f.endswith(".rs"):
            continue
        raw = open(os.path.join(tests_dir, f)).read()
        code = strip_literals(raw)
        bodies = {}
        tests = []
        for m in re.finditer(r"\bfn\s+(\w+)[^{;]*\{", code):
            end = closing(code, m.end() - 1)
            # The raw text: a binary named in a string (`env!("CARGO_BIN_EXE_...")`) counts.
            bodies[m.group(1)] = raw[m.end():end]
            head = code[max(0, m.start() - 120):m.start()]
            if re.search(r"#\[(tokio::)?test[^\]]*\]\s*(async\s+)?$", head):
                tests.append((m.group(1), 1))
        for m in re.finditer(r"on_every_backend!\s*\(([^)]*)\)", code):
            for name in re.findall(r"\b(\w+)\b", m.group(1)):
                if name in bodies and name != "current_thread":
                    tests.append((name, 3))

        def starts(name, seen):
            if name in seen:
                return False
            seen.add(name)
            body = bodies.get(name, "")
            if STARTS.search(body):
                return True
            return any(starts(c, seen) for c in set(re.findall(r"\b(\w+)\s*\(", body)) if c in bodies)

        for t, cases in tests:
            total += cases
            starting += cases * starts(t, set())
    return total, starting


ITEM = re.compile(r"^\s*pub\s+(?:(?:async|const|unsafe|extern\s+\"C\")\s+)*(?:fn|struct|enum|trait|type|const|static)\s+(\w+)", re.M)


def rust_files(d):
    for base, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x not in ("target", ".git")]
        for f in sorted(files):
            if f.endswith(".rs"):
                yield os.path.join(base, f)


def inside_only(root):
    """(library crate, [(file:line, name)]) of pub items named only inside their crate,
    and the number of bare `pub` items of the binary crates."""
    crates_dir = os.path.join(root, "crates")
    libraries = []
    if os.path.isdir(crates_dir):
        libraries = [os.path.join(crates_dir, c) for c in sorted(os.listdir(crates_dir))
                     if c != "testkit" and os.path.isfile(os.path.join(crates_dir, c, "src", "lib.rs"))]
    every = [p for d in ("src", "tests", "examples", "bench", "fuzz", "crates")
             for p in rust_files(os.path.join(root, d))]
    words = {p: set(re.findall(r"\b\w+\b", strip_literals(open(p).read()))) for p in every}
    found = []
    for lib in libraries:
        outside = set()
        for p, w in words.items():
            if not p.startswith(lib + os.sep):
                outside |= w
        items = []
        for p in rust_files(os.path.join(lib, "src")):
            code = strip_literals(open(p).read())
            for m in ITEM.finditer(code):
                if m.group(1) not in outside:
                    items.append((f"{os.path.relpath(p, root)}:{line_of(code, m.start())}", m.group(1)))
        found.append((os.path.relpath(lib, root), items))
    binary_pub = 0
    for d in [os.path.join(root, "src")] + [os.path.join(crates_dir, c, "src") for c in
                                            (os.listdir(crates_dir) if os.path.isdir(crates_dir) else [])
                                            if not os.path.isfile(os.path.join(crates_dir, c, "src", "lib.rs"))]:
        for p in rust_files(d):
            binary_pub += len(ITEM.findall(strip_literals(open(p).read())))
    return found, binary_pub


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    listing = "--list" in sys.argv
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    big_files, long_fns = [], []
    pub_items = pub_restricted = 0
    for path in crate_sources(root):
        raw = open(path).read()
        code = strip_literals(raw)
        spans = test_spans(code)
        test_lines = sum(line_of(code, b) - line_of(code, a) + 1 for a, b in spans)
        lines = raw.count("\n") - test_lines
        rel = os.path.relpath(path, root)
        if lines > FILE_LIMIT:
            big_files.append((lines, rel))
        for name, first, length in functions(code, spans):
            if length > FN_LIMIT:
                long_fns.append((length, f"{rel}:{first} {name}"))
        outside = list(code)
        for a, b in spans:
            outside[a:b + 1] = " " * (b + 1 - a)
        outside = "".join(outside)
        pub_items += len(PUB.findall(outside))
        pub_restricted += len(PUB_CRATE.findall(outside))
    total, starting = binary_tests(root)
    only_inside, binary_pub = inside_only(root)
    print(f"files over {FILE_LIMIT} lines: {len(big_files)}")
    if listing:
        for lines, rel in sorted(big_files, reverse=True):
            print(f"  {lines:5} {rel}")
    print(f"functions over {FN_LIMIT} lines: {len(long_fns)}")
    if listing:
        for length, where in sorted(long_fns, reverse=True):
            print(f"  {length:5} {where}")
    print(f"pub items: {pub_items} (pub(crate)/pub(super)/pub(in): {pub_restricted})")
    print(f"pub items named only inside their library crate: {sum(len(i) for _, i in only_inside)}"
          + "".join(f", {c}: {len(i)}" for c, i in only_inside))
    if listing:
        for c, items in only_inside:
            for where, name in items:
                print(f"  {where} {name}")
    print(f"pub items of the binary crates: {binary_pub}")
    print(f"integration tests: {total}, starting the binary: {starting}")


if __name__ == "__main__":
    main()
