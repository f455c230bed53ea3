"""Renders spans captured by otlp_receiver.py as an SVG timeline.

    python trace_view.py SPANS.jsonl [--out timeline.svg] [--title TEXT]

With --out, prints a JSON summary: spans, traces, links (drawn as arrows),
links_elsewhere (to spans not captured).

One row per span, grouped by trace (the traces in the order they began, each
span under its parent), a bar from its start to its end on a shared time
axis, coloured by kind (SERVER, CLIENT, INTERNAL). A span link (a replay's,
a 409's or a 422's to the execution's SERVER span) is drawn as a dashed
arrow from the linking span to the span it names, when that span is among
the captured ones; otherwise the link is listed beside the span.

Uses only the standard library. For the docs: a replay's span next to the
original it answers from.
"""

import argparse
import html
import json
import sys

COLOURS = {
    "SERVER": "#4c78a8",
    "CLIENT": "#f58518",
    "INTERNAL": "#54a24b",
}
ROW = 26
BAR = 16
LEFT = 330  # the label column
WIDTH = 1000
TOP = 50


def load(path):
    spans = []
    with open(path) if path != "-" else sys.stdin as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            v = json.loads(line)
            if "span_id" in v:
                spans.append(v)
    return spans


def ordered(spans):
    """Traces by first start; in each, parents before children (depth first)."""
    by_trace = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    rows = []
    traces = sorted(
        by_trace.values(), key=lambda ss: min(s["start_time_unix_nano"] for s in ss)
    )
    for ss in traces:
        ids = {s["span_id"] for s in ss}
        children = {}
        roots = []
        for s in ss:
            if s["parent_span_id"] in ids:
                children.setdefault(s["parent_span_id"], []).append(s)
            else:
                roots.append(s)

        def walk(s, depth):
            rows.append((s, depth))
            for c in sorted(children.get(s["span_id"], []), key=lambda c: c["start_time_unix_nano"]):
                walk(c, depth + 1)

        for r in sorted(roots, key=lambda r: r["start_time_unix_nano"]):
            walk(r, 0)
        rows.append((None, 0))  # a gap between traces
    return rows[:-1] if rows else rows


def label(s):
    a = s.get("attributes", {})
    extra = []
    if "http.response.status_code" in a:
        extra.append(str(a["http.response.status_code"]))
    if "idempotency.outcome" in a:
        extra.append(str(a["idempotency.outcome"]))
    return s["name"] + (f"  [{', '.join(extra)}]" if extra else "")


def render(spans, title):
    rows = ordered(spans)
    t0 = min(s["start_time_unix_nano"] for s in spans)
    t1 = max(s["end_time_unix_nano"] for s in spans)
    span_ns = max(t1 - t0, 1)
    plot = WIDTH - LEFT - 20

    def x(t):
        return LEFT + (t - t0) * plot / span_ns

    height = TOP + ROW * len(rows) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#b22"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{html.escape(title)}</text>',
        f'<text x="{WIDTH - 20}" y="22" text-anchor="end" fill="#555">'
        f"{span_ns / 1e6:.1f} ms</text>",
    ]
    drawn = {"links": 0, "links_elsewhere": 0}
    where = {}
    trace_no = 0
    previous_trace = None
    for i, (s, depth) in enumerate(rows):
        y = TOP + i * ROW
        if s is None:
            continue
        if s["trace_id"] != previous_trace:
            trace_no += 1
            previous_trace = s["trace_id"]
            out.append(
                f'<text x="10" y="{y - 4}" fill="#777" font-size="10">trace '
                f'{s["trace_id"]}</text>'
            )
        x0, x1 = x(s["start_time_unix_nano"]), x(s["end_time_unix_nano"])
        x1 = max(x1, x0 + 2)
        colour = COLOURS.get(s["kind"], "#999")
        where[s["span_id"]] = (x0, x1, y + BAR / 2)
        out.append(
            f'<text x="{10 + depth * 14}" y="{y + BAR - 3}">{html.escape(label(s))}</text>'
        )
        out.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{x1 - x0:.1f}" height="{BAR}" rx="3" '
            f'fill="{colour}"><title>{html.escape(s["kind"])} {html.escape(s["name"])} '
            f'{(s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e6:.2f} ms'
            f"</title></rect>"
        )
    for s, _ in rows:
        if s is None:
            continue
        for link in s.get("links", []):
            src = where[s["span_id"]]
            dst = where.get(link["span_id"])
            if dst is None:
                drawn["links_elsewhere"] += 1
                out.append(
                    f'<text x="{src[1] + 6:.1f}" y="{src[2] + 4:.1f}" fill="#b22" font-size="10">'
                    f'link → {link["trace_id"][:8]}…/{link["span_id"]}</text>'
                )
                continue
            drawn["links"] += 1
            sx, sy = src[0], src[2]
            dx, dy = dst[0] + 4, dst[2]
            bend = min(sx, dx) - 25
            out.append(
                f'<path d="M{sx:.1f},{sy:.1f} C{bend:.1f},{sy:.1f} {bend:.1f},{dy:.1f} '
                f'{dx:.1f},{dy:.1f}" fill="none" stroke="#b22" stroke-dasharray="5,3" '
                f'stroke-width="1.5" marker-end="url(#arrow)"><title>span link: '
                f'{html.escape(str(s.get("attributes", {}).get("idempotency.outcome", "")))}'
                f" → the original</title></path>"
            )
    ly = height - 18
    lx = LEFT
    for kind, colour in COLOURS.items():
        out.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{lx + 16}" y="{ly}">{kind}</text>')
        lx += 100
    out.append(
        f'<path d="M{lx},{ly - 4} L{lx + 30},{ly - 4}" stroke="#b22" stroke-dasharray="5,3" '
        f'marker-end="url(#arrow)"/><text x="{lx + 36}" y="{ly}">span link</text>'
    )
    out.append("</svg>")
    drawn["traces"] = trace_no
    drawn["spans"] = len(spans)
    return "\n".join(out) + "\n", drawn


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spans", help="a file of span lines (otlp_receiver.py's output), or -")
    p.add_argument("--out", help="the SVG file (default: stdout)")
    p.add_argument("--title", default="idemproxy: a replay linked to its original")
    args = p.parse_args()
    spans = load(args.spans)
    if not spans:
        sys.exit("no spans")
    svg, drawn = render(spans, args.title)
    if args.out:
        with open(args.out, "w") as f:
            f.write(svg)
        print(json.dumps(drawn))
    else:
        sys.stdout.write(svg)


if __name__ == "__main__":
    main()
