#!/usr/bin/env python3
"""Checks the guide's internal links: every relative link in README.md and
docs/**/*.md must name a file that exists, and every #anchor must be an
anchor of that page (a heading's `{#id}`, an `<a id="...">`, or the id
mdBook gives a heading without one). Links inside code are ignored; links
to other sites are not fetched.

    python3 docs/check-links.py                  # exit 1 and a list when one is broken
    python3 docs/check-links.py --allow-missing docs/clients.md

--allow-missing names a page that may not exist yet (links to it, and its
anchors, are then not checked). Standard library only.
"""

import argparse
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
EXPLICIT = re.compile(r"\s*\{#([A-Za-z0-9_-]+)\}\s*$")
HTML_ID = re.compile(r"<a\s+id=\"([^\"]+)\"\s*>")


def strip_code(text, inline=True):
    """The text without fenced blocks and (with `inline`) inline code, line
    numbers kept. A heading's inline code is part of its id, as mdBook makes it."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append("")
            continue
        if m:
            fence = m.group(1)
            out.append("")
            continue
        out.append(re.sub(r"`+[^`]*`+", "", line) if inline else line)
    return out


def slug(title):
    """mdBook's id for a heading: lower case, markup dropped, spaces to '-'."""
    title = re.sub(r"<[^>]+>", "", title)
    title = title.replace("`", "")
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    s = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return s.replace(" ", "-")


def anchors(path):
    ids, seen = set(), {}
    for line in strip_code(open(path, encoding="utf-8").read(), inline=False):
        ids.update(HTML_ID.findall(line))
        h = HEADING.match(line)
        if not h:
            continue
        title = h.group(2)
        e = EXPLICIT.search(title)
        if e:
            ids.add(e.group(1))
            continue
        base = slug(title)
        n = seen.get(base, 0)
        ids.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return ids


def pages():
    yield os.path.join(ROOT, "README.md")
    for d, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in sorted(files):
            if f.endswith(".md"):
                yield os.path.join(d, f)


CITATION = re.compile(r"(?:README\.md|docs/[A-Za-z0-9_/.-]+?\.md)(?:#[A-Za-z0-9_.-]*[A-Za-z0-9_-])?")
SECTION = re.compile(r"§\s*\d")
RFC_SECTION = re.compile(r"RFC \d+[^§]{0,3}§\s*\d")


def check_citations(cache, broken):
    """The code cites the guide by path and anchor (`docs/reference/behaviour.md#conflict`):
    each cited page and anchor must exist. A numbered section (`§8`) may only be an RFC's."""
    count = 0
    for top in ("src", "tests", "bench", "examples"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if not f.endswith((".rs", ".py", ".sh")):
                    continue
                path = os.path.join(d, f)
                for n, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
                    where = f"{os.path.relpath(path, ROOT)}:{n}"
                    if top == "src" and SECTION.search(line) and not RFC_SECTION.search(line):
                        broken.append(f"{where}: a numbered section (§) that is not an RFC's: cite the guide")
                    for m in CITATION.finditer(line):
                        count += 1
                        file_part, _, anchor = m.group(0).partition("#")
                        dest = os.path.join(ROOT, file_part)
                        if not os.path.exists(dest):
                            broken.append(f"{where}: {m.group(0)}: no such file")
                            continue
                        if anchor:
                            if dest not in cache:
                                cache[dest] = anchors(dest)
                            if anchor not in cache[dest]:
                                broken.append(f"{where}: {m.group(0)}: no anchor #{anchor}")
    return count


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allow-missing", action="append", default=[], metavar="FILE",
                    help="a page that may not exist yet, relative to the repository")
    args = ap.parse_args()
    allowed = {os.path.normpath(os.path.join(ROOT, f)) for f in args.allow_missing}

    cache, broken, count = {}, [], 0
    for page in pages():
        lines = strip_code(open(page, encoding="utf-8").read())
        for n, line in enumerate(lines, 1):
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # another site, mailto:
                count += 1
                file_part, _, anchor = target.partition("#")
                dest = page if not file_part else os.path.normpath(os.path.join(os.path.dirname(page), file_part))
                where = f"{os.path.relpath(page, ROOT)}:{n}"
                if not os.path.exists(dest):
                    if dest not in allowed:
                        broken.append(f"{where}: {target}: no such file")
                    continue
                if anchor and dest.endswith(".md"):
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where}: {target}: no anchor #{anchor} in {os.path.relpath(dest, ROOT)}")
    cited = check_citations(cache, broken)
    for b in broken:
        print(b)
    print(f"{count} links and {cited} citations in the code checked, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
