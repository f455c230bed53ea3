#!/usr/bin/env python3
"""idemproxy side-by-side benchmark.

Starts, on loopback ports of its own: an nginx-light upstream with a fixed JSON
answer, nginx-light as a plain reverse proxy (keep-alive upstream pool), a
redis-server, and idemproxy (release build). Then measures, alternating
idemproxy and nginx in every repetition:

  - pass-through GET (wrk), and the upstream directly as a reference;
  - protected POST with a new key per request;
  - replay of stored keys;
  - a duplicate storm (many clients, few keys);
  - latency at a fixed rate below saturation (oha, open loop, latency-corrected);
  - RSS of idemproxy idle and with 1,000 open connections;
  - store round trips per new key and per replay, seen by Redis (MONITOR),
    in a separate, untimed verification run.

Prints one table of medians with min-max and the ratios to nginx, writes
bench/results/latest.json and an SVG chart (bench/results/latest.svg).

    bench/bench.py [--reps 5] [--duration 5] [--rate 10000] [--svg PATH]

Needs: nginx (nginx-light), wrk, redis-server, oha (`cargo install oha`), cargo.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = '{"id":"pay_1","status":"succeeded","amount":4200}'


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, deadline=10.0):
    end = time.time() + deadline
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on port {port}")


def wait_http(url, deadline=15.0):
    end = time.time() + deadline
    while time.time() < end:
        try:
            if urllib.request.urlopen(url, timeout=0.5).status == 200:
                return
        except Exception:
            time.sleep(0.05)
    sys.exit(f"{url} never answered 200")


class Stack:
    """The processes under test, on free ports, in a temp dir."""

    def __init__(self, workdir):
        self.dir = workdir
        self.procs = []
        self.up_port, self.ngx_port, self.redis_port = free_port(), free_port(), free_port()
        self.idem_port, self.admin_port = free_port(), free_port()

    def spawn(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)
        self.procs.append(p)
        return p

    def nginx_conf(self, name, workers, server_block, upstream_block=""):
        path = os.path.join(self.dir, f"{name}.conf")
        with open(path, "w") as f:
            f.write(f"""worker_processes {workers};
daemon off;
pid {self.dir}/{name}.pid;
error_log {self.dir}/{name}.err warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  client_body_temp_path {self.dir}/{name}-body;
  proxy_temp_path {self.dir}/{name}-proxy;
  {upstream_block}
  server {{ {server_block} }}
}}
""")
        return path

    def start(self, idem_bin):
        up = self.nginx_conf(
            "upstream", 1,
            f"listen 127.0.0.1:{self.up_port} backlog=4096; default_type application/json; "
            f"location / {{ return 200 '{BODY}'; }}",
        )
        self.upstream = self.spawn(["nginx", "-c", up])
        px = self.nginx_conf(
            "proxy", 2,
            f"listen 127.0.0.1:{self.ngx_port} backlog=4096; location / {{ proxy_pass http://up; "
            "proxy_http_version 1.1; proxy_set_header Connection \"\"; }",
            f"upstream up {{ server 127.0.0.1:{self.up_port}; keepalive 256; }}",
        )
        self.nginx = self.spawn(["nginx", "-c", px])
        self.redis = self.spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", self.dir])
        cfg = os.path.join(self.dir, "idemproxy.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{self.idem_port}"
admin_listen = "127.0.0.1:{self.admin_port}"
upstream = "http://127.0.0.1:{self.up_port}"

[store]
backend = "redis"
url = "redis://127.0.0.1:{self.redis_port}/0"

[[routes]]
name = "payments"
path = "/v1/payments"
""")
        # Access logs off, as for nginx (`access_log off`): RUST_LOG=warn.
        env = dict(os.environ, RUST_LOG="warn")
        self.idem = self.spawn([idem_bin, "--config", cfg], env=env)
        for port in (self.up_port, self.ngx_port, self.redis_port, self.idem_port):
            wait_port(port)
        wait_http(f"http://127.0.0.1:{self.admin_port}/readyz")

    def stop(self):
        for p in reversed(self.procs):
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def url(self, which, path="/x"):
        port = {"idemproxy": self.idem_port, "nginx": self.ngx_port, "direct": self.up_port}[which]
        return f"http://127.0.0.1:{port}{path}"


# ---------------------------------------------------------------------------
# Load generators

# Counts answers by status in every thread and prints them at the end ("STATUSES 200=...,409=...").
STATUS_LUA = r"""
statuses = {}
threads_list = {}
response = function(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads_list) do
    local s = t:get("statuses")
    if s then for k, v in pairs(s) do total[k] = (total[k] or 0) + v end end
  end
  local parts = {}
  for k, v in pairs(total) do table.insert(parts, k .. "=" .. v) end
  io.write("STATUSES " .. table.concat(parts, ",") .. "\n")
end
"""

NEWKEY_LUA = STATUS_LUA + r"""
-- A key no one used before, per request: "<run tag>-<thread>-<counter>".
local counter, threads, prefix = 0, 0, ""
function setup(thread) threads = threads + 1; thread:set("id", threads); table.insert(threads_list, thread) end
function init(args) prefix = "%s-" .. tostring(id) .. "-" end
request = function()
  counter = counter + 1
  return wrk.format("POST", "/v1/payments",
    {["Idempotency-Key"] = prefix .. counter, ["Content-Type"] = "application/json"}, '{"amount":4200}')
end
"""

KEYS_LUA = STATUS_LUA + r"""
-- Keys drawn from a fixed set: replays (set stored first) or a duplicate storm (few keys).
function setup(thread) table.insert(threads_list, thread) end
request = function()
  local k = math.random(1, %d)
  return wrk.format("POST", "/v1/payments",
    {["Idempotency-Key"] = "%s-" .. k, ["Content-Type"] = "application/json"}, '{"amount":4200}')
end
"""


def lua(workdir, name, text):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def wrk(url, duration, connections=64, threads=2, script=None):
    args = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency"]
    if script:
        args += ["-s", script]
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = parse_wrk_latency(re.search(r"50%\s+([\d.]+\w+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    statuses = re.search(r"STATUSES (\S*)", out)
    return {"rps": rps, "p50_ms": p50, "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "statuses": statuses.group(1) if statuses else ""}


def parse_wrk_latency(text):
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def oha(url, rate, seconds, headers=(), method="GET", body=None):
    args = ["oha", "--no-tui", "-q", str(rate), "-z", f"{seconds}s", "-c", "64", "--latency-correction",
            "--output-format", "json", "-m", method]
    for h in headers:
        args += ["-H", h]
    if body is not None:
        args += ["-d", body]
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    p = d["latencyPercentiles"]
    return {"rps": d["summary"]["requestsPerSec"], "p50_ms": p["p50"] * 1000, "p99_ms": p["p99"] * 1000,
            "p999_ms": p["p99.9"] * 1000, "success": d["summary"]["successRate"]}


def post(url, key):
    req = urllib.request.Request(url, data=b'{"amount":4200}', method="POST",
                                 headers={"Idempotency-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()
        return r.status, r.headers.get("Idempotent-Replayed")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rss_with_connections(stack, n=1000):
    """Opens n keep-alive connections, each having made one request (one after the
    other, so the upstream pool stays small), holds them open and reads RSS."""
    socks = []
    req = b"GET /x HTTP/1.1\r\nHost: bench\r\n\r\n"
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", stack.idem_port))
            s.sendall(req)
            socks.append(s)
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(BODY.encode()):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        time.sleep(0.5)  # let allocator statistics settle; not a synchronisation
        return rss_kib(stack.idem.pid)
    finally:
        for s in socks:
            s.close()


def round_trips(stack, n=50):
    """Counts top-level Redis commands on record keys per request (MONITOR), untimed."""
    mon = socket.create_connection(("127.0.0.1", stack.redis_port))
    mon.sendall(b"MONITOR\r\n")
    buf = b""
    while b"+OK\r\n" not in buf:
        buf += mon.recv(4096)
    buf = buf.split(b"+OK\r\n", 1)[1]
    url = stack.url("idemproxy", "/v1/payments")

    def window(marker):
        nonlocal buf
        with socket.create_connection(("127.0.0.1", stack.redis_port)) as c:
            c.sendall(f"ECHO {marker}\r\n".encode())
            c.recv(100)
        lines = []
        while True:
            while b"\r\n" not in buf:
                buf += mon.recv(65536)
            line, buf = buf.split(b"\r\n", 1)
            text = line.decode(errors="replace")
            if marker in text:
                return lines
            if '"idemproxy:' in text and "[0 lua]" not in text:
                lines.append(text)

    window("rt-start")
    tag = f"rt-{time.time_ns()}"
    for i in range(n):
        post(url, f"{tag}-{i}")
    new = len(window("rt-new"))
    for i in range(n):
        status, replayed = post(url, f"{tag}-{i}")
        assert replayed == "true", "expected a replay"
    replay = len(window("rt-replay"))
    mon.close()
    return new / n, replay / n


def median_range(values):
    return statistics.median(values), min(values), max(values)


def fmt(values, unit=""):
    med, lo, hi = median_range(values)
    if unit == "rps":
        return f"{med/1000:7.1f}k ({lo/1000:.1f}-{hi/1000:.1f})"
    return f"{med:7.2f} ({lo:.2f}-{hi:.2f})"


def svg_chart(rows, path):
    """A small two-panel bar chart: throughput and p99 per scenario, idemproxy vs nginx."""
    w, h, pad = 900, 420, 60
    panel_w = (w - 3 * pad) / 2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>']

    def panel(x0, title, series, unit):
        maxv = max([v for _, a, b in series for v in (a, b) if v is not None] + [1])
        parts.append(f'<text x="{x0}" y="24" font-size="14" font-weight="bold">{title}</text>')
        n = len(series)
        slot = panel_w / max(n, 1)
        base = h - pad
        for i, (label, a, b) in enumerate(series):
            x = x0 + i * slot
            for j, (v, color) in enumerate(((a, "#2b6cb0"), (b, "#a0aec0"))):
                if v is None:
                    continue
                bh = (h - 2 * pad) * v / maxv
                bx = x + 6 + j * (slot - 12) / 2
                parts.append(f'<rect x="{bx:.1f}" y="{base - bh:.1f}" width="{(slot - 12) / 2 - 2:.1f}" '
                             f'height="{bh:.1f}" fill="{color}"/>')
                parts.append(f'<text x="{bx:.1f}" y="{base - bh - 4:.1f}" font-size="10">{v:.3g}{unit}</text>')
            parts.append(f'<text x="{x + 4:.1f}" y="{base + 14}" font-size="10">{label}</text>')
        parts.append(f'<line x1="{x0}" y1="{base}" x2="{x0 + panel_w}" y2="{base}" stroke="black"/>')

    thr = [(r["label"], r.get("idem_rps"), r.get("nginx_rps")) for r in rows if r.get("idem_rps") or r.get("nginx_rps")]
    lat = [(r["label"], r.get("idem_p99"), r.get("nginx_p99")) for r in rows if r.get("idem_p99")]
    panel(pad, 'throughput, k req/s (blue: idemproxy, grey: nginx; "upstream": no proxy)', [(l, a and a / 1000, b and b / 1000) for l, a, b in thr], "k")
    panel(2 * pad + panel_w, "p99 latency at a fixed rate, ms", lat, "")
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--rate", type=int, default=10000, help="fixed request rate for the latency runs")
    ap.add_argument("--svg", default=os.path.join(ROOT, "bench", "results", "latest.svg"))
    args = ap.parse_args()

    for tool in ("nginx", "wrk", "redis-server", "oha", "cargo"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install nginx-light wrk redis-server; cargo install oha --locked")
    subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
    idem_bin = os.path.join(ROOT, "target", "release", "idemproxy")

    workdir = tempfile.mkdtemp(prefix="idemproxy-bench-")
    stack = Stack(workdir)
    results = {}
    try:
        stack.start(idem_bin)
        idle_rss = rss_kib(stack.idem.pid)
        # Keys to replay: stored once, untimed.
        for i in range(1, 1001):
            post(stack.url("idemproxy", "/v1/payments"), f"replay-{i}")
        replay = lua(workdir, "replay.lua", KEYS_LUA % (1000, "replay"))
        d = args.duration
        # Warm-up (pools, allocator, JIT-free but caches).
        for which in ("idemproxy", "nginx"):
            wrk(stack.url(which), 2)

        series = {k: [] for k in ("direct", "pt_idem", "pt_nginx", "newkey", "replay", "storm",
                                  "pt_idem_p50", "pt_nginx_p50")}
        storm_statuses = []
        for rep in range(args.reps):
            order = ("idemproxy", "nginx") if rep % 2 == 0 else ("nginx", "idemproxy")
            for which in order:
                r = wrk(stack.url(which), d)
                series["pt_idem" if which == "idemproxy" else "pt_nginx"].append(r["rps"])
                series["pt_idem_p50" if which == "idemproxy" else "pt_nginx_p50"].append(r["p50_ms"])
            series["direct"].append(wrk(stack.url("direct"), d)["rps"])
            newkey = lua(workdir, f"newkey-{rep}.lua", NEWKEY_LUA % f"bench{time.time_ns()}")
            r = wrk(stack.url("idemproxy"), d, script=newkey)
            if r["non2xx"]:
                print(f"warning: non-2xx answers with new keys: {r['statuses']}", file=sys.stderr)
            series["newkey"].append(r["rps"])
            series["replay"].append(wrk(stack.url("idemproxy"), d, script=replay)["rps"])
            storm = lua(workdir, f"storm-{rep}.lua", KEYS_LUA % (10, f"storm{rep}"))
            r = wrk(stack.url("idemproxy"), d, connections=256, script=storm)
            series["storm"].append(r["rps"])
            storm_statuses.append(r["statuses"])
            print(f"rep {rep + 1}/{args.reps}: pass-through idemproxy {series['pt_idem'][-1]:.0f}/s, "
                  f"nginx {series['pt_nginx'][-1]:.0f}/s, new keys {series['newkey'][-1]:.0f}/s, "
                  f"replays {series['replay'][-1]:.0f}/s", file=sys.stderr)

        # Latency at a fixed rate, open loop.
        lat = {}
        for which in ("idemproxy", "nginx", "direct"):
            lat[f"pt_{which}"] = oha(stack.url(which), args.rate, 10)
        lat["replay"] = oha(stack.url("idemproxy", "/v1/payments"), args.rate, 10, method="POST",
                            headers=("Idempotency-Key: replay-1", "Content-Type: application/json"),
                            body='{"amount":4200}')
        conn_rss = rss_with_connections(stack)
        rt_new, rt_replay = round_trips(stack)
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    med = lambda k: statistics.median(series[k])
    nginx = med("pt_nginx")
    rows = [
        ("upstream directly (reference)", fmt(series["direct"], "rps"), "", f"{med('direct') / nginx:.2f}x", ""),
        ("pass-through GET", fmt(series["pt_idem"], "rps"), fmt(series["pt_nginx"], "rps"),
         f"{med('pt_idem') / nginx:.2f}x", ">= 1.0x"),
        ("pass-through p50 (ms, wrk -c64)", fmt(series["pt_idem_p50"]), fmt(series["pt_nginx_p50"]),
         f"{med('pt_idem_p50') - med('pt_nginx_p50'):+.2f} ms", "added <= nginx's"),
        ("protected POST, new keys", fmt(series["newkey"], "rps"), "", f"{med('newkey') / nginx:.2f}x", ">= 0.75x"),
        ("replay", fmt(series["replay"], "rps"), "", f"{med('replay') / nginx:.2f}x", ">= 1.3x"),
        ("duplicate storm (256 clients, 10 keys)", fmt(series["storm"], "rps"), "", f"{med('storm') / nginx:.2f}x", ""),
    ]
    print()
    print(f"{'scenario':42} {'idemproxy':24} {'nginx proxy':24} {'ratio to nginx':16} target")
    for r in rows:
        print(f"{r[0]:42} {r[1]:24} {r[2]:24} {r[3]:16} {r[4]}")
    print()
    print(f"latency at {args.rate} req/s (oha, open loop, latency-corrected), ms:")
    for k, label in (("pt_direct", "upstream directly"), ("pt_idemproxy", "pass-through, idemproxy"),
                     ("pt_nginx", "pass-through, nginx"), ("replay", "replay, idemproxy")):
        v = lat[k]
        print(f"  {label:28} p50 {v['p50_ms']:.3f}  p99 {v['p99_ms']:.3f}  p99.9 {v['p999_ms']:.3f}  "
              f"({v['rps']:.0f} req/s, success {v['success']:.3f})")
    added = {w: lat[f"pt_{w}"]["p50_ms"] - lat["pt_direct"]["p50_ms"] for w in ("idemproxy", "nginx")}
    print(f"  p50 added over the upstream directly: idemproxy {added['idemproxy']:+.3f} ms, "
          f"nginx {added['nginx']:+.3f} ms (target: idemproxy's <= nginx's)")
    print(f"RSS idle {idle_rss / 1024:.1f} MiB; with 1,000 open connections {conn_rss / 1024:.1f} MiB (target <= 40 MiB)")
    print(f"store round trips per request (MONITOR): new key {rt_new:.2f}, replay {rt_replay:.2f} (target 2 / 1)")
    print(f"storm answers (status=count per repetition): {'; '.join(storm_statuses)}")

    results = {"series": series, "latency": lat, "rss_kib": {"idle": idle_rss, "connections_1000": conn_rss},
               "round_trips": {"new_key": rt_new, "replay": rt_replay}, "storm_statuses": storm_statuses,
               "reps": args.reps, "duration_s": args.duration, "rate": args.rate}
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "latest.json"), "w") as f:
        json.dump(results, f, indent=1)
    chart_rows = [
        {"label": "pass-through", "idem_rps": med("pt_idem"), "nginx_rps": nginx,
         "idem_p99": lat["pt_idemproxy"]["p99_ms"], "nginx_p99": lat["pt_nginx"]["p99_ms"]},
        {"label": "new keys", "idem_rps": med("newkey"), "nginx_rps": None},
        {"label": "replay", "idem_rps": med("replay"), "nginx_rps": None, "idem_p99": lat["replay"]["p99_ms"], "nginx_p99": None},
        {"label": "storm", "idem_rps": med("storm"), "nginx_rps": None},
        {"label": "upstream", "idem_rps": None, "nginx_rps": med("direct")},
    ]
    svg_chart(chart_rows, args.svg)
    print(f"chart: {args.svg}")


if __name__ == "__main__":
    main()
