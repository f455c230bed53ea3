#!/usr/bin/env python3
"""Draws docs/performance.svg: idemproxy against nginx, as ranges over runs.

The figures are those of the table "Where each target stands (2026-12-02)"
in docs/dev/benchmarks-journal.md (eight full runs of bench/bench.py, each
`--only http1 --reps 3 --duration 3`, their JSON in bench/results). Each bar
is the range over the runs of idemproxy's figure divided by nginx's in the
same run; the pale bar beneath it is the floor (hyper doing only what a
pass-through or a replay needs, measured beside it), where one was measured.

    python3 bench/chart.py                 # writes docs/performance.svg
    python3 bench/chart.py --out FILE

Standard library only; the SVG uses the reader's sans-serif font and fetches
nothing.
"""

import argparse
import os

# (label, idemproxy (low, high), floor (low, high) or None)
CPU = [
    ("pass-through", (1.12, 1.31), (1.01, 1.21)),
    ("new key", (1.59, 2.28), None),
    ("replay", (0.76, 1.00), (0.64, 0.77)),
]
THROUGHPUT = [
    ("pass-through", (0.81, 0.92), (0.79, 0.83)),
    ("new key", (0.40, 0.56), None),
    ("replay", (0.96, 1.33), (1.10, 1.26)),
]

WIDTH, LEFT, RIGHT = 800, 120, 30
ROW, BAR = 34, 12
SCALE_MAX = 2.5


def x(v):
    return LEFT + (WIDTH - LEFT - RIGHT) * v / SCALE_MAX


def panel(title, rows, top, better):
    out = [f'<text x="{LEFT}" y="{top}" class="title">{title}</text>',
           f'<text x="{WIDTH - RIGHT}" y="{top}" class="note" text-anchor="end">{better}</text>']
    y0 = top + 14
    height = ROW * len(rows)
    for tick in (0, 0.5, 1.0, 1.5, 2.0, 2.5):
        cls = "nginx" if tick == 1.0 else "grid"
        out.append(f'<line x1="{x(tick):.1f}" y1="{y0}" x2="{x(tick):.1f}" y2="{y0 + height}" class="{cls}"/>')
        out.append(f'<text x="{x(tick):.1f}" y="{y0 + height + 14}" class="tick" text-anchor="middle">{tick:.1f}×</text>')
    for i, (label, (lo, hi), floor) in enumerate(rows):
        y = y0 + i * ROW + 8
        out.append(f'<text x="{LEFT - 8}" y="{y + BAR - 2}" class="label" text-anchor="end">{label}</text>')
        if floor:
            flo, fhi = floor
            out.append(f'<rect x="{x(flo):.1f}" y="{y + BAR}" width="{max(x(fhi) - x(flo), 2):.1f}" height="6" class="floor"/>')
        out.append(f'<rect x="{x(lo):.1f}" y="{y}" width="{max(x(hi) - x(lo), 2):.1f}" height="{BAR}" class="bar"/>')
        out.append(f'<text x="{x(hi) + 6:.1f}" y="{y + BAR - 2}" class="value">{lo:.2f}–{hi:.2f}×</text>')
    return out, y0 + height + 34


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "docs", "performance.svg"))
    args = ap.parse_args()

    body = []
    part, top = panel("CPU per request, relative to nginx", CPU, 24, "lower is better")
    body += part
    part, top = panel("Requests per second, relative to nginx", THROUGHPUT, top + 8, "higher is better")
    body += part
    legend_y = top
    body += [
        f'<rect x="{LEFT}" y="{legend_y - 10}" width="18" height="{BAR}" class="bar"/>',
        f'<text x="{LEFT + 24}" y="{legend_y}" class="note">idemproxy, range over eight runs</text>',
        f'<rect x="{LEFT + 250}" y="{legend_y - 7}" width="18" height="6" class="floor"/>',
        f'<text x="{LEFT + 274}" y="{legend_y}" class="note">floor: the same stack doing only what is needed</text>',
        f'<line x1="{LEFT + 585}" y1="{legend_y - 12}" x2="{LEFT + 585}" y2="{legend_y + 2}" class="nginx"/>',
        f'<text x="{LEFT + 591}" y="{legend_y}" class="note">nginx = 1.0×</text>',
    ]
    height = legend_y + 16
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
        "<title>idemproxy against nginx: CPU per request and requests per second, pinned to one vCPU</title>",
        "<style>",
        "text { font-family: sans-serif; fill: #222; }",
        ".title { font-size: 14px; font-weight: bold; }",
        ".label { font-size: 13px; }",
        ".value, .tick, .note { font-size: 11px; fill: #444; }",
        ".bar { fill: #2b6cb0; }",
        ".floor { fill: #9fc3e6; }",
        ".grid { stroke: #ddd; stroke-width: 1; }",
        ".nginx { stroke: #c05621; stroke-width: 2; stroke-dasharray: 4 3; }",
        "</style>",
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
    ] + body + ["</svg>"]
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(svg) + "\n")
    print(f"wrote {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
