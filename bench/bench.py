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
    in a separate, untimed verification run;
  - HTTP/2 pass-through GET (h2load, cleartext HTTP/2 with prior knowledge):
    idemproxy and nginx (`listen ... http2`), both to the same HTTP/1.1
    upstream, the upstream's own h2c port as a reference, and idemproxy with
    `upstream_protocol = "h2c"` to that port (nginx cannot proxy over h2);
  - WebSocket echo round trips (bench/ws-bench): K connections each with one
    message in flight, 1 KiB and 64 KiB messages, through a second idemproxy
    whose upstream is the echo server, through nginx, and directly.

Every wrk run also reads the proxy's and Redis's CPU time from /proc and
reports CPU microseconds per request. --pin puts the proxy under test (one
worker: nginx worker_processes 1, idemproxy workers = 1) on CPU 1 and the
load generators, the upstream and Redis on CPU 0. The http1 group adds:
small new keys' p99 alone and beside 8 MiB replays, open-loop latency at 40 %
of nginx's maximum (up to 3 repetitions, medians), Redis INFO commandstats
per new key, and a check of the performance issue's targets. --bin measures
a given binary instead of building this checkout.

Prints tables of medians with min-max and the ratios to nginx, writes
bench/results/latest.json and an SVG chart (bench/results/latest.svg).

    bench/bench.py [--pin] [--floors] [--reps 5] [--duration 5] [--rate N] [--svg PATH]
                   [--only http1,h2,ws,big] [--json PATH]
                   [--h2-clients 16] [--h2-streams 4] [--ws-connections 64] [--ws-sizes 1024,65536]

--floors (with http1) also measures, in every repetition beside the
targets, the floors of bench/floor.py on the proxy's CPU:
examples/hyper_floor forwarding through idemproxy's own upstream pool with
nothing else, forwarding as the contract asks and no more (the pass-through's
floor: forwarding headers, hop-by-hop stripping, `upstream_timeout`), and
replaying as the contract asks and no more (the replay's); the targets table
then shows each floor's ratio beside the measured one, from the same run, and
the latency the contract's minimum forward adds in the open loop.

--only runs some groups of scenarios: http1 (the wrk/oha scenarios, RSS and
round trips), h2, ws; without it all run. big runs only http1's 8 MiB
scenario (small new keys' p99 alone and beside 8 MiB replays), to compare
builds with --bin. A partial run writes
bench/results/latest-<groups>.json (not latest.json) and no chart unless
http1 is among them.

Needs: nginx (nginx-light), wrk, redis-server, oha (`cargo install oha`), cargo;
for h2: h2load (`apt-get install nghttp2-client`).
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
BIG = 8 << 20
# --pin: the proxy under test (idemproxy or nginx, one worker each) on one
# vCPU, the load generator, the upstream and Redis on the other.
PROXY_CPU, LOAD_CPU = "1", "0"
# The load generators' command prefix (taskset with --pin).
LOAD = []


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


def stop_all(procs):
    """SIGTERM in reverse start order, then wait (SIGKILL after 10 s)."""
    for p in reversed(procs):
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def nginx_has_http2():
    """Whether this nginx was built with the HTTP/2 module (Debian's nginx-light is)."""
    out = subprocess.run(["nginx", "-V"], capture_output=True, text=True)
    return "http_v2_module" in out.stdout + out.stderr


class Stack:
    """The processes under test, on free ports, in a temp dir."""

    def __init__(self, workdir, pin=False):
        self.dir = workdir
        self.pin = pin
        self.procs = []
        self.up_port, self.ngx_port, self.redis_port = free_port(), free_port(), free_port()
        self.idem_port, self.admin_port = free_port(), free_port()
        # HTTP/2: the upstream's and nginx's h2c ports; an idemproxy with h2c to the upstream.
        self.up_h2_port, self.ngx_h2_port = free_port(), free_port()
        self.idem_h2c_port, self.idem_h2c_admin = free_port(), free_port()
        # WebSocket: the echo server, nginx's port for it, an idemproxy in front of it.
        self.echo_port, self.ngx_ws_port = free_port(), free_port()
        self.idem_ws_port, self.idem_ws_admin = free_port(), free_port()

    def spawn(self, args, proxy=False, **kw):
        """Starts a process; with --pin, a proxy under test on CPU 1 and anything else on CPU 0."""
        if self.pin:
            args = ["taskset", "-c", PROXY_CPU if proxy else LOAD_CPU] + args
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)
        self.procs.append(p)
        return p

    def log(self, name):
        return open(os.path.join(self.dir, f"{name}.log"), "w")

    def logs(self):
        """What the idemproxy instances wrote (warnings and errors: RUST_LOG=warn) and nginx's error logs."""
        out = {}
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".log", ".err")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text = f.read().strip()
                if text:
                    out[name] = text
        return out

    def nginx_conf(self, name, workers, server_block, upstream_block="", more_servers=""):
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
  {more_servers}
}}
""")
        return path

    def idem_conf(self, name, port, admin, upstream, protocol=None):
        path = os.path.join(self.dir, f"{name}.toml")
        proto = f'upstream_protocol = "{protocol}"\n' if protocol else ""
        # Pinned: one worker thread, as nginx's one worker process.
        workers = "workers = 1\n" if self.pin else ""
        with open(path, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
upstream = "{upstream}"
# Above the default (256): the RSS row holds 1,000 connections open.
max_connections = 2048
{workers}{proto}
[store]
backend = "redis"
url = "redis://127.0.0.1:{self.redis_port}/0"

[[routes]]
name = "payments"
path = "/v1/payments"

# 8 MiB answers: the large records replayed beside small new keys.
[[routes]]
name = "big"
path = "/v1/big"
max_response_body = "16MiB"
""")
        return path

    def start(self, idem_bin, groups=("http1",), h2=False, ws_bin=None):
        """Starts what `groups` need. h2: nginx has the HTTP/2 module (h2c
        listeners on the upstream and the proxy). ws_bin: the echo server."""
        up_h2 = f"listen 127.0.0.1:{self.up_h2_port} http2 backlog=4096; " if h2 else ""
        up = self.nginx_conf(
            "upstream", 1,
            f"listen 127.0.0.1:{self.up_port} backlog=4096; {up_h2}default_type application/json; "
            f"location / {{ return 200 '{BODY}'; }} "
            # 8 MiB from a file, to POST too (the static module refuses POST with 405: served as GET).
            f"location = /v1/big {{ default_type application/octet-stream; alias {self.big_file()}; "
            "error_page 405 =200 $uri; }",
        )
        self.upstream = self.spawn(["nginx", "-c", up])
        more = ""
        if h2:
            # The same proxy location on a cleartext HTTP/2 listener (prior knowledge).
            more += (f"server {{ listen 127.0.0.1:{self.ngx_h2_port} http2 backlog=4096; location / {{ "
                     "proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }\n")
        if ws_bin:
            # WebSocket: HTTP/1.1 to the upstream with the Upgrade and Connection headers passed on.
            # An upgraded connection is copied through one proxy_buffer_size buffer each way:
            # 8k, as idemproxy's (tokio's copy_bidirectional), not the default one page (4k).
            more += (f"  server {{ listen 127.0.0.1:{self.ngx_ws_port} backlog=4096; location / {{ "
                     f"proxy_pass http://127.0.0.1:{self.echo_port}; proxy_http_version 1.1; "
                     "proxy_set_header Upgrade $http_upgrade; proxy_set_header Connection \"upgrade\"; "
                     "proxy_buffer_size 8k; proxy_read_timeout 3600s; } }\n")
        px = self.nginx_conf(
            "proxy", 1 if self.pin else 2,
            f"listen 127.0.0.1:{self.ngx_port} backlog=4096; location / {{ proxy_pass http://up; "
            "proxy_http_version 1.1; proxy_set_header Connection \"\"; }",
            f"upstream up {{ server 127.0.0.1:{self.up_port}; keepalive 256; }}",
            more,
        )
        self.nginx = self.spawn(["nginx", "-c", px], proxy=True)
        self.redis = self.spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", self.dir])
        # Access logs off, as for nginx (`access_log off`): RUST_LOG=warn.
        env = dict(os.environ, RUST_LOG="warn")
        cfg = self.idem_conf("idemproxy", self.idem_port, self.admin_port, f"http://127.0.0.1:{self.up_port}")
        self.idem = self.spawn([idem_bin, "--config", cfg], proxy=True, env=env, stderr=self.log("idemproxy"))
        ports, admins = [self.up_port, self.ngx_port, self.redis_port, self.idem_port], [self.admin_port]
        if h2 and "h2" in groups:
            cfg = self.idem_conf("idemproxy-h2c", self.idem_h2c_port, self.idem_h2c_admin,
                                 f"http://127.0.0.1:{self.up_h2_port}", protocol="h2c")
            self.idem_h2c = self.spawn([idem_bin, "--config", cfg], proxy=True, env=env,
                                       stderr=self.log("idemproxy-h2c"))
            ports += [self.up_h2_port, self.ngx_h2_port, self.idem_h2c_port]
            admins.append(self.idem_h2c_admin)
        if ws_bin:
            self.echo = self.spawn([ws_bin, "echo", f"127.0.0.1:{self.echo_port}"], stderr=None)
            cfg = self.idem_conf("idemproxy-ws", self.idem_ws_port, self.idem_ws_admin,
                                 f"http://127.0.0.1:{self.echo_port}")
            self.idem_ws = self.spawn([idem_bin, "--config", cfg], proxy=True, env=env,
                                      stderr=self.log("idemproxy-ws"))
            ports += [self.echo_port, self.ngx_ws_port, self.idem_ws_port]
            admins.append(self.idem_ws_admin)
        for port in ports:
            wait_port(port)
        for admin in admins:
            wait_http(f"http://127.0.0.1:{admin}/readyz")

    def start_floors(self, floor_bin):
        """examples/hyper_floor on the proxy's CPU: forwarding through idemproxy's
        pool (the pass-through's floor) and replaying as the contract asks (the replay's)."""
        self.floors = {}
        for name, mode in (("floor_bare", f"proxy:{self.up_port}"), ("floor_pt", f"passthrough:{self.up_port}"),
                           ("floor_replay", f"replay:{self.redis_port}")):
            port = free_port()
            # A current-thread runtime, as each of idemproxy's worker threads runs.
            proc = self.spawn([floor_bin, f"127.0.0.1:{port}", mode], proxy=True,
                              env=dict(os.environ, FLOOR_RUNTIME="current"))
            wait_port(port)
            self.floors[name] = (port, proc.pid)

    def big_file(self):
        path = os.path.join(self.dir, "big.bin")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(os.urandom(BIG))
            # nginx's workers run as another user: the file and its directory readable to them.
            os.chmod(self.dir, 0o755)
            os.chmod(path, 0o644)
        return path

    def stop(self):
        stop_all(self.procs)

    def url(self, which, path="/x"):
        port = {"idemproxy": self.idem_port, "nginx": self.ngx_port, "direct": self.up_port}[which]
        return f"http://127.0.0.1:{port}{path}"

    def h2_url(self, which, path="/x"):
        port = {"idemproxy": self.idem_port, "nginx": self.ngx_h2_port, "direct": self.up_h2_port,
                "idemproxy_h2c": self.idem_h2c_port}[which]
        return f"http://127.0.0.1:{port}{path}"

    def ws_url(self, which):
        port = {"idemproxy": self.idem_ws_port, "nginx": self.ngx_ws_port, "direct": self.echo_port}[which]
        return f"ws://127.0.0.1:{port}/echo"


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
local path, keys, prefix = "%s", %d, "%s"
function setup(thread) table.insert(threads_list, thread) end
request = function()
  local k = math.random(1, keys)
  return wrk.format("POST", path,
    {["Idempotency-Key"] = prefix .. "-" .. k, ["Content-Type"] = "application/json"}, '{"amount":4200}')
end
"""


def lua(workdir, name, text):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def wrk(url, duration, connections=64, threads=2, script=None, meter=None):
    """A closed-loop wrk run. meter: {name: [pid, ...]}, whose CPU time per
    request (µs, from /proc) is added as "<name>_us"."""
    args = LOAD + ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency"]
    if script:
        args += ["-s", script]
    before = {k: cpu_seconds(pids) for k, pids in (meter or {}).items()}
    out = subprocess.run(args + [url], capture_output=True, text=True, check=True).stdout
    after = {k: cpu_seconds(pids) for k, pids in (meter or {}).items()}
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    p50 = parse_wrk_latency(re.search(r"50%\s+([\d.]+\w+)", out).group(1))
    p99 = parse_wrk_latency(re.search(r"99%\s+([\d.]+\w+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    statuses = re.search(r"STATUSES (\S*)", out)
    r = {"rps": rps, "requests": requests, "p50_ms": p50, "p99_ms": p99,
         "non2xx": int(non2xx.group(1)) if non2xx else 0, "statuses": statuses.group(1) if statuses else ""}
    for k in before:
        r[f"{k}_us"] = (after[k] - before[k]) / max(requests, 1) * 1e6
    return r


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids):
    """User + system CPU time of processes (every thread), from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICK


def with_children(pid):
    """A process and its children (nginx: the master and its workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid] + [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return [pid]


def parse_wrk_latency(text):
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def oha(url, rate, seconds, headers=(), method="GET", body=None):
    args = LOAD + ["oha", "--no-tui", "-q", str(rate), "-z", f"{seconds}s", "-c", "64", "--latency-correction",
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


def h2load(url, duration, clients, streams, threads=2, h1=False):
    """h2load over cleartext HTTP/2 with prior knowledge (or HTTP/1.1 with h1),
    for `duration` seconds after a 1 s warm-up."""
    args = LOAD + ["h2load", f"-t{threads}", f"-c{clients}", f"-m{streams}", f"-D{duration}", "--warm-up-time=1"]
    if h1:
        args.append("--h1")
    out = subprocess.run(args + [url], capture_output=True, text=True).stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                    r"(\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)\s", out)
    if not (m and req and codes):
        sys.exit(f"h2load gave no figures for {url}:\n{out}")
    return {"rps": float(m.group(1)), "succeeded": int(req.group(4)), "failed": int(req.group(5)),
            "errored": int(req.group(6)), "timeout": int(req.group(7)), "non2xx": sum(int(c) for c in codes.groups()[1:]),
            "statuses": dict(zip(("2xx", "3xx", "4xx", "5xx"), (int(c) for c in codes.groups()))),
            "mean_ms": parse_wrk_latency(mean.group(1) + mean.group(2)) if mean else None}


def ws_load(ws_bin, url, connections, size, seconds):
    """bench/ws-bench: `connections` WebSockets, one `size`-byte message in flight on each."""
    out = subprocess.run(LOAD + [ws_bin, "load", url, str(connections), str(size), str(seconds)],
                         capture_output=True, text=True, timeout=seconds + 120)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        sys.exit(f"ws-bench load {url} failed ({out.returncode}): {out.stderr}")
    return json.loads(lines[-1])


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


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


def parked_connections(stack):
    """idemproxy's `idemproxy_parked_connections` gauge (0 for a build without it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.admin_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("idemproxy_parked_connections "):
            return int(float(line.split()[1]))
    return 0


def rss_with_connections(stack, n=1000):
    """Opens n keep-alive connections, each having made one request (one after the
    other, so the upstream pool stays small), holds them open and reads RSS twice:
    0.5 s after the last one answered, and once they are idle — parked (idemproxy
    frees an idle connection's HTTP state after 250 ms and gives freed memory
    back at most once a second) or, for a build without parking, 3 s later."""
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
        at_once = rss_kib(stack.idem.pid)
        deadline = time.time() + 3
        while time.time() < deadline and parked_connections(stack) < n:
            time.sleep(0.05)
        time.sleep(1.5)  # one period of giving freed memory back, and a margin
        return at_once, rss_kib(stack.idem.pid), parked_connections(stack)
    finally:
        for s in socks:
            s.close()


def round_trips(stack, n=50):
    """Counts top-level Redis commands on record keys per request (MONITOR), untimed.
    A reserve's read (`GETRANGE key 0 65535`) goes in one write with its
    `SET NX PX`, so it is not counted as a round trip of its own."""
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
            reserve_read = '"GETRANGE"' in text and text.endswith('"0" "65535"')
            if '"idemproxy:' in text and "[0 lua]" not in text and not reserve_read:
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


def run_http1(stack, args, workdir):
    """The HTTP/1.1 scenarios (wrk, oha), RSS and store round trips, with the
    proxies' and Redis's CPU time per request."""
    idle_rss = rss_kib(stack.idem.pid)
    # Keys to replay: stored once, untimed.
    for i in range(1, 1001):
        post(stack.url("idemproxy", "/v1/payments"), f"replay-{i}")
    replay = lua(workdir, "replay.lua", KEYS_LUA % ("/v1/payments", 1000, "replay"))
    d = args.duration
    idem = {"proxy": [stack.idem.pid], "redis": [stack.redis.pid]}
    nginx = {"proxy": with_children(stack.nginx.pid)}
    # Warm-up (pools, allocator, caches).
    for which in ("idemproxy", "nginx"):
        wrk(stack.url(which), 2)

    runs = {k: [] for k in ("direct", "pt_idem", "pt_nginx", "newkey", "replay", "storm")}
    floors = {}
    for name, (port, pid) in (getattr(stack, "floors", None) or {}).items():
        replaying = name == "floor_replay"
        floors[name] = (f"http://127.0.0.1:{port}" + ("/v1/payments" if replaying else "/x"),
                        replay if replaying else None, [pid])
    if floors:
        for url, script, _ in floors.values():
            wrk(url, 2, script=script)
        runs.update({k: [] for k in floors})
    for rep in range(args.reps):
        order = ("idemproxy", "nginx") if rep % 2 == 0 else ("nginx", "idemproxy")
        for which in order:
            if which == "idemproxy":
                runs["pt_idem"].append(wrk(stack.url(which), d, meter=idem))
            else:
                runs["pt_nginx"].append(wrk(stack.url(which), d, meter=nginx))
        runs["direct"].append(wrk(stack.url("direct"), d))
        for k, (url, script, pids) in floors.items():
            runs[k].append(wrk(url, d, script=script, meter={"proxy": pids}))
        newkey = lua(workdir, f"newkey-{rep}.lua", NEWKEY_LUA % f"bench{time.time_ns()}")
        r = wrk(stack.url("idemproxy"), d, script=newkey, meter=idem)
        if r["non2xx"]:
            print(f"warning: non-2xx answers with new keys: {r['statuses']}", file=sys.stderr)
        runs["newkey"].append(r)
        runs["replay"].append(wrk(stack.url("idemproxy"), d, script=replay, meter=idem))
        storm = lua(workdir, f"storm-{rep}.lua", KEYS_LUA % ("/v1/payments", 10, f"storm{rep}"))
        runs["storm"].append(wrk(stack.url("idemproxy"), d, connections=256, script=storm))
        print(f"rep {rep + 1}/{args.reps}: pass-through idemproxy {runs['pt_idem'][-1]['rps']:.0f}/s "
              f"({runs['pt_idem'][-1]['proxy_us']:.1f} µs), nginx {runs['pt_nginx'][-1]['rps']:.0f}/s "
              f"({runs['pt_nginx'][-1]['proxy_us']:.1f} µs), new keys {runs['newkey'][-1]['rps']:.0f}/s "
              f"({runs['newkey'][-1]['proxy_us']:.1f} µs + Redis {runs['newkey'][-1]['redis_us']:.1f}), "
              f"replays {runs['replay'][-1]['rps']:.0f}/s ({runs['replay'][-1]['proxy_us']:.1f} µs)",
              file=sys.stderr)

    # Latency at 40 % of nginx's pass-through maximum, open loop.
    # Repeated (at most 3 times), the order rotated, as one 10-second run
    # swings by more than the difference being measured; with --floors the
    # contract's minimum forward is measured beside them.
    rate = args.rate or int(0.4 * statistics.median(r["rps"] for r in runs["pt_nginx"]))
    open_loop = {"pt_idemproxy": stack.url("idemproxy"), "pt_nginx": stack.url("nginx"),
                 "pt_direct": stack.url("direct")}
    if "floor_pt" in floors:
        open_loop["pt_floor_pt"] = floors["floor_pt"][0]
    lat = {"rate": rate, "reps": []}
    for rep in range(max(1, min(args.reps, 3))):
        names = list(open_loop)
        names = names[rep % len(names):] + names[:rep % len(names)]
        one = {k: oha(open_loop[k], rate, 10) for k in names}
        one["replay"] = oha(stack.url("idemproxy", "/v1/payments"), rate, 10, method="POST",
                            headers=("Idempotency-Key: replay-1", "Content-Type: application/json"),
                            body='{"amount":4200}')
        lat["reps"].append(one)
        print(f"open loop rep {rep + 1}: p50/p99 ms " + ", ".join(
            f"{k[3:] if k.startswith('pt_') else k} {v['p50_ms']:.3f}/{v['p99_ms']:.3f}" for k, v in one.items()),
            file=sys.stderr)
    for k in lat["reps"][0]:
        lat[k] = {f: statistics.median(r[k][f] for r in lat["reps"]) for f in lat["reps"][0][k]}
    redis_stats = redis_commandstats(stack, workdir, args.duration)
    # RSS with idle connections before the 8 MiB replays: what those leave in
    # glibc's arena varies from run to run (measured again after them, below).
    conn_rss, idle_conn_rss, parked = rss_with_connections(stack)
    big = run_big(stack, args, workdir)
    _, after_big_rss, _ = rss_with_connections(stack)
    rt_new, rt_replay = round_trips(stack)
    return {"layout": "pinned" if stack.pin else "unpinned", "runs": runs, "latency": lat, "big": big,
            "redis_commandstats": redis_stats,
            "rss_kib": {"idle": idle_rss, "connections_1000": idle_conn_rss,
                        "connections_1000_at_once": conn_rss, "parked": parked,
                        "connections_1000_after_big": after_big_rss},
            "round_trips": {"new_key": rt_new, "replay": rt_replay}}


def redis_command(port, *args):
    """One command to Redis, its reply as text (bulk string or status)."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(f"*{len(args)}\r\n".encode() + b"".join(f"${len(a)}\r\n{a}\r\n".encode() for a in args))
        data = b""
        while True:
            data += c.recv(65536)
            if data.startswith(b"+") and data.endswith(b"\r\n"):
                return data[1:-2].decode()
            if data.startswith(b"$"):
                head, _, rest = data.partition(b"\r\n")
                if len(rest) >= int(head[1:]) + 2:
                    return rest[:int(head[1:])].decode()


def redis_commandstats(stack, workdir, duration):
    """What Redis spends per new key, by command (INFO commandstats after
    CONFIG RESETSTAT), and how many commands each read of the connection carried."""
    redis_command(stack.redis_port, "CONFIG", "RESETSTAT")
    script = lua(workdir, "newkey-stats.lua", NEWKEY_LUA % f"stats{time.time_ns()}")
    r = wrk(stack.url("idemproxy"), duration, script=script)
    stats = {}
    for line in redis_command(stack.redis_port, "INFO", "commandstats").splitlines():
        m = re.match(r"cmdstat_(\w+):calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", line)
        if m:
            stats[m.group(1)] = {"calls": int(m.group(2)), "usec_per_call": float(m.group(4))}
    info = dict(l.split(":", 1) for l in redis_command(stack.redis_port, "INFO", "stats").splitlines() if ":" in l)
    return {"requests": r["requests"], "commands": stats, "reads": int(info.get("total_reads_processed", 0))}


def run_big(stack, args, workdir):
    """Small new keys (wrk -c8, closed loop) alone, then while 4 clients replay
    8 MiB records: p99 of the small ones, each way, per repetition."""
    url = stack.url("idemproxy", "/v1/big")
    for i in range(1, 5):
        req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Idempotency-Key": f"big-{i}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert len(r.read()) == BIG, "the 8 MiB answer came back short"
    big = lua(workdir, "big.lua", KEYS_LUA % ("/v1/big", 4, "big"))
    out = {"alone": [], "beside": [], "big_rps": []}
    for rep in range(args.reps):
        small = lua(workdir, f"small-{rep}.lua", NEWKEY_LUA % f"small{time.time_ns()}")
        out["alone"].append(wrk(stack.url("idemproxy"), args.duration, connections=8, threads=1, script=small))
        small = lua(workdir, f"small-b-{rep}.lua", NEWKEY_LUA % f"smallb{time.time_ns()}")
        bg = subprocess.Popen(LOAD + ["wrk", "-t1", "-c4", f"-d{args.duration + 2}s", "-s", big, url],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            time.sleep(1)  # the big replays are under way (a head start, not a synchronisation)
            out["beside"].append(wrk(stack.url("idemproxy"), args.duration, connections=8, threads=1,
                                     script=small))
        finally:
            text = bg.communicate(timeout=args.duration + 60)[0]
        m = re.search(r"Requests/sec:\s+([\d.]+)", text)
        out["big_rps"].append(float(m.group(1)) if m else 0.0)
        print(f"big rep {rep + 1}/{args.reps}: small new keys p99 alone {out['alone'][-1]['p99_ms']:.2f} ms, "
              f"beside 8 MiB replays {out['beside'][-1]['p99_ms']:.2f} ms ({out['big_rps'][-1]:.0f} big/s)",
              file=sys.stderr)
    return out


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def paired_ratio(a, b, key):
    """Median of the per-repetition ratios a[i][key] / b[i][key] (measured back to back)."""
    return statistics.median(x[key] / y[key] for x, y in zip(a, b) if y[key])


def targets_http1(res):
    """(label, value, target text, met) for every target of the performance issue."""
    runs, lat, big = res["runs"], res["latency"], res["big"]
    ng = runs["pt_nginx"]
    t = []
    floor_of = {"pt_idem": "floor_pt", "replay": "floor_replay"}
    for key, label, rps_min, cpu_max in (("pt_idem", "pass-through GET", 0.95, 1.0),
                                         ("newkey", "protected POST, new key", 0.45, 2.0),
                                         ("replay", "replay", 1.2, 0.75)):
        r = paired_ratio(runs[key], ng, "rps")
        c = paired_ratio(runs[key], ng, "proxy_us")
        floor = runs.get(floor_of.get(key, ""))
        fr = f" (floor {paired_ratio(floor, ng, 'rps'):.2f}x)" if floor else ""
        fc = f" (floor {paired_ratio(floor, ng, 'proxy_us'):.2f}x)" if floor else ""
        t.append((f"{label}: req/s vs nginx", f"{r:.2f}x{fr}", f">= {rps_min}x", r >= rps_min))
        t.append((f"{label}: proxy CPU/request vs nginx", f"{c:.2f}x{fc}", f"<= {cpu_max}x", c <= cpu_max))
    rss = res["rss_kib"]["connections_1000"] / 1024
    t.append(("RSS with 1,000 idle connections", f"{rss:.1f} MiB", "<= 20 MiB", rss <= 20))
    redis = med(runs["newkey"], "redis_us")
    t.append(("Redis CPU per new key", f"{redis:.1f} µs", "<= 12 µs", redis <= 12))
    b = statistics.median(x["p99_ms"] / y["p99_ms"] for x, y in zip(big["beside"], big["alone"]))
    t.append(("small new keys' p99 beside 8 MiB replays", f"{b:.2f}x alone", "<= 2x", b <= 2))
    reps = lat.get("reps") or [lat]
    for p in ("p50", "p99"):
        # What each proxy adds over the upstream directly, in the same
        # repetition; the median over repetitions.
        added = {w: statistics.median(r[f"pt_{w}"][f"{p}_ms"] - r["pt_direct"][f"{p}_ms"] for r in reps)
                 for w in ("idemproxy", "nginx", "floor_pt") if f"pt_{w}" in reps[0]}
        floor = f" (floor {added['floor_pt'] * 1000:+.0f})" if "floor_pt" in added else ""
        t.append((f"open loop at {lat['rate']}/s: {p} added, idemproxy vs nginx",
                  f"{added['idemproxy'] * 1000:+.0f}{floor} vs {added['nginx'] * 1000:+.0f} µs", "<= nginx's",
                  added["idemproxy"] <= added["nginx"]))
    return t


def report_big(big):
    ratio = statistics.median(x["p99_ms"] / y["p99_ms"] for x, y in zip(big["beside"], big["alone"]))
    print(f"small new keys (wrk -t1 -c8), p99 ms: alone {fmt([r['p99_ms'] for r in big['alone']])}, "
          f"beside 4 clients replaying 8 MiB records {fmt([r['p99_ms'] for r in big['beside']])} "
          f"(paired ratio {ratio:.2f}x; {statistics.median(big['big_rps']):.0f} big replays/s; small new keys "
          f"{med(big['alone'], 'rps'):.0f}/s alone, {med(big['beside'], 'rps'):.0f}/s beside)")


def report_http1(res, args):
    runs, lat = res["runs"], res["latency"]
    ng_rps, ng_us = med(runs["pt_nginx"], "rps"), med(runs["pt_nginx"], "proxy_us")
    print()
    print(f"layout: {res['layout']}" + (" (proxies with one worker on CPU 1; wrk, upstream and Redis on CPU 0)"
                                        if res["layout"] == "pinned" else ""))
    print(f"{'scenario':40} {'req/s':24} {'proxy µs/req':16} {'Redis µs/req':14} vs nginx: req/s, CPU (paired)")
    rows = (("direct", "upstream directly (reference)"), ("pt_nginx", "nginx proxy, pass-through GET"),
            ("pt_idem", "idemproxy, pass-through GET"), ("newkey", "idemproxy, protected POST, new key"),
            ("replay", "idemproxy, replay"), ("storm", "idemproxy, duplicate storm (256 c, 10 keys)"),
            ("floor_bare", "floor: hyper through idemproxy's pool"),
            ("floor_pt", "floor: the contract's minimum forward"),
            ("floor_replay", "floor: the contract's minimum replay"))
    for key, label in rows:
        if key not in runs:
            continue
        rs = runs[key]
        cpu = fmt([r["proxy_us"] for r in rs]) if "proxy_us" in rs[0] else ""
        redis = f"{med(rs, 'redis_us'):.1f}" if "redis_us" in rs[0] else ""
        ratio = f"{paired_ratio(rs, runs['pt_nginx'], 'rps'):.2f}x"
        if "proxy_us" in rs[0]:
            ratio += f", {paired_ratio(rs, runs['pt_nginx'], 'proxy_us'):.2f}x"
        print(f"{label:40} {fmt([r['rps'] for r in rs], 'rps'):24} {cpu:16} {redis:14} {ratio}")
    print(f"(nginx pass-through: {ng_rps / 1000:.1f}k/s, {ng_us:.1f} µs CPU per request)")
    print()
    print(f"latency at {lat['rate']} req/s (40 % of nginx's maximum; oha, open loop, latency-corrected), ms"
          + (f", medians of {len(lat['reps'])}:" if "reps" in lat else ":"))
    for k, label in (("pt_direct", "upstream directly"), ("pt_idemproxy", "pass-through, idemproxy"),
                     ("pt_nginx", "pass-through, nginx"), ("pt_floor_pt", "the contract's minimum forward"),
                     ("replay", "replay, idemproxy")):
        if k not in lat:
            continue
        v = lat[k]
        print(f"  {label:28} p50 {v['p50_ms']:.3f}  p99 {v['p99_ms']:.3f}  p99.9 {v['p999_ms']:.3f}  "
              f"({v['rps']:.0f} req/s, success {v['success']:.3f})")
    report_big(res["big"])
    rk = res["rss_kib"]
    print(f"RSS idle {rk['idle'] / 1024:.1f} MiB; with 1,000 open connections "
          f"{rk.get('connections_1000_at_once', rk['connections_1000']) / 1024:.1f} MiB 0.5 s after the last "
          f"answer, {rk['connections_1000'] / 1024:.1f} MiB once idle ({rk.get('parked', 0)} parked)"
          + (f"; once idle after the 8 MiB replays {rk['connections_1000_after_big'] / 1024:.1f} MiB"
             if "connections_1000_after_big" in rk else ""))
    rs = res["redis_commandstats"]
    n = max(rs["requests"], 1)
    per = ", ".join(f"{k} {v['calls'] / n:.2f}x {v['usec_per_call']:.2f} µs" for k, v in sorted(rs["commands"].items())
                    if v["calls"] >= n / 10)
    print(f"Redis per new key (INFO commandstats, {n} new keys): {per}; "
          f"{rs['reads'] / n:.2f} reads of the connection per new key")
    rt = res["round_trips"]
    print(f"store round trips per request (MONITOR): new key {rt['new_key']:.2f}, replay {rt['replay']:.2f}")
    print()
    print(f"{'target':58} {'measured':28} {'target':12} met")
    for label, value, target, met in targets_http1(res):
        print(f"{label:58} {value:28} {target:12} {'yes' if met else 'NO'}")


def chart_http1(res, svg):
    runs, lat = res["runs"], res["latency"]
    chart_rows = [
        {"label": "pass-through", "idem_rps": med(runs["pt_idem"], "rps"), "nginx_rps": med(runs["pt_nginx"], "rps"),
         "idem_p99": lat["pt_idemproxy"]["p99_ms"], "nginx_p99": lat["pt_nginx"]["p99_ms"]},
        {"label": "new keys", "idem_rps": med(runs["newkey"], "rps"), "nginx_rps": None},
        {"label": "replay", "idem_rps": med(runs["replay"], "rps"), "nginx_rps": None,
         "idem_p99": lat["replay"]["p99_ms"], "nginx_p99": None},
        {"label": "storm", "idem_rps": med(runs["storm"], "rps"), "nginx_rps": None},
        {"label": "upstream", "idem_rps": None, "nginx_rps": med(runs["direct"], "rps")},
    ]
    svg_chart(chart_rows, svg)
    print(f"chart: {svg}")


def paired(a, b):
    """Per-repetition ratios a[i] / b[i] (the two were measured back to back)."""
    return [x / y for x, y in zip(a, b) if y]


def run_h2(stack, args, nginx_h2):
    """HTTP/2 pass-through GET with h2load. Both proxies speak cleartext HTTP/2
    (prior knowledge) to h2load and HTTP/1.1 to the same upstream; nginx only
    proxies over HTTP/1.x. References: the upstream's own h2c listener, and an
    idemproxy with upstream_protocol = "h2c" to it. Without nginx's HTTP/2
    module: idemproxy against the upstream directly over HTTP/1.1 (h2load --h1)."""
    c, m, d = args.h2_clients, args.h2_streams, args.duration
    if nginx_h2:
        targets = {"idemproxy": (stack.h2_url("idemproxy"), False), "nginx": (stack.h2_url("nginx"), False),
                   "direct": (stack.h2_url("direct"), False), "idemproxy_h2c": (stack.h2_url("idemproxy_h2c"), False)}
    else:
        print("nginx has no HTTP/2 module here: the HTTP/2 row compares idemproxy with the upstream "
              "directly over HTTP/1.1 (h2load --h1)", file=sys.stderr)
        targets = {"idemproxy": (stack.h2_url("idemproxy"), False), "direct": (stack.url("direct"), True)}
    # Warm-up: connections, pools, allocator.
    for which in ("idemproxy", "nginx", "idemproxy_h2c"):
        if which in targets:
            url, h1 = targets[which]
            h2load(url, 2, c, m, h1=h1)
    runs = {k: [] for k in targets}
    for rep in range(args.reps):
        order = [k for k in (("idemproxy", "nginx") if rep % 2 == 0 else ("nginx", "idemproxy")) if k in targets]
        order += [k for k in ("direct", "idemproxy_h2c") if k in targets]
        for which in order:
            url, h1 = targets[which]
            # --h1 has no streams: as many connections as h2 streams in flight, one request each.
            runs[which].append(h2load(url, d, c * m, 1, h1=True) if h1 else h2load(url, d, c, m))
        print(f"h2 rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]['rps']:.0f}/s" for k, v in runs.items()),
              file=sys.stderr)
    return {"nginx_http2": nginx_h2, "clients": c, "streams": m, "runs": runs}


def report_h2(res):
    runs = res["runs"]
    rps = {k: [r["rps"] for r in v] for k, v in runs.items()}
    base = "nginx" if "nginx" in rps else "direct"
    ref = statistics.median(rps[base])
    c, m = res["clients"], res["streams"]
    print()
    print(f"HTTP/2 pass-through GET, h2load -t2 -c{c} -m{m} (cleartext, prior knowledge); "
          f"ratio to {'nginx' if base == 'nginx' else 'the upstream directly (HTTP/1.1)'}, paired min-max in ()")
    labels = {"idemproxy": "idemproxy (HTTP/1.1 to the upstream)", "nginx": "nginx proxy (HTTP/1.1 to the upstream)",
              "direct": "upstream directly (reference)" + ("" if base == "nginx" else ", HTTP/1.1"),
              "idemproxy_h2c": "idemproxy, upstream_protocol = h2c"}
    for k in ("idemproxy", "nginx", "direct", "idemproxy_h2c"):
        if k not in rps:
            continue
        ratios = paired(rps[k], rps[base])
        ok = sum(r["succeeded"] for r in runs[k])
        bad = sum(r["errored"] + r["timeout"] + r["non2xx"] for r in runs[k])
        note = f"  NOT A THROUGHPUT: {bad} of {ok + bad} answers non-2xx, errored or timed out" if bad else ""
        print(f"  {labels[k]:42} {fmt(rps[k], 'rps'):24} {statistics.median(rps[k]) / ref:5.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}){note}")


def run_ws(stack, args, ws_bin):
    """WebSocket echo: one message in flight per connection, through idemproxy,
    through nginx, and to the echo server directly."""
    k, d = args.ws_connections, args.duration
    sizes = [int(x) for x in args.ws_sizes.split(",")]
    for which in ("idemproxy", "nginx"):
        ws_load(ws_bin, stack.ws_url(which), k, sizes[0], 1)
    fds_idle = open_fds(stack.idem_ws.pid)
    runs = {size: {w: [] for w in ("idemproxy", "nginx", "direct")} for size in sizes}
    fds_after = []
    for rep in range(args.reps):
        for size in sizes:
            order = ("idemproxy", "nginx") if rep % 2 == 0 else ("nginx", "idemproxy")
            for which in order + ("direct",):
                r = ws_load(ws_bin, stack.ws_url(which), k, size, d)
                runs[size][which].append(r)
                if r["errors"] or r["connect_errors"] or r["mismatched"] or r["closed_cleanly"] != k:
                    print(f"warning: ws {which} {size} B: {r['errors']} errors, {r['connect_errors']} connect "
                          f"errors, {r['mismatched']} mismatched, {r['closed_cleanly']}/{k} closed cleanly; "
                          f"first: {r['first_error']}", file=sys.stderr)
            # The tunnels of the runs above are over: idemproxy's sockets to them should be closed.
            time.sleep(0.5)  # a margin for the last closes, not a synchronisation
            fds_after.append(open_fds(stack.idem_ws.pid))
            print(f"ws rep {rep + 1}/{args.reps} {size} B: " +
                  ", ".join(f"{w} {v[-1]['msgs_per_s']:.0f} msg/s" for w, v in runs[size].items()) +
                  f"; idemproxy fds {fds_after[-1]} (idle {fds_idle})", file=sys.stderr)
    return {"connections": k, "sizes": sizes, "runs": {str(s): v for s, v in runs.items()},
            "idemproxy_fds": {"idle": fds_idle, "after_each_size": fds_after}}


def report_ws(res):
    k = res["connections"]
    print()
    print(f"WebSocket echo, {k} connections with one message in flight each; msg/s and MiB/s of payload each way; "
          "ratio to nginx, paired min-max in ()")
    for size in res["sizes"]:
        runs = res["runs"][str(size)]
        mps = {w: [r["msgs_per_s"] for r in v] for w, v in runs.items()}
        ref = statistics.median(mps["nginx"])
        name = f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} B"
        for w, label in (("idemproxy", "idemproxy"), ("nginx", "nginx proxy"), ("direct", "echo server directly")):
            ratios = paired(mps[w], mps["nginx"])
            mib = statistics.median(r["mib_per_s"] for r in runs[w])
            p50 = statistics.median(r["rtt_p50_ms"] for r in runs[w])
            p99 = statistics.median(r["rtt_p99_ms"] for r in runs[w])
            bad = sum(r["errors"] + r["connect_errors"] + r["mismatched"] + (k - r["closed_cleanly"]) for r in runs[w])
            print(f"  {name:7} {label:22} {fmt(mps[w], 'rps'):24} {mib:8.1f} MiB/s  "
                  f"{statistics.median(mps[w]) / ref:5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})  "
                  f"rtt p50 {p50:.3f} p99 {p99:.3f} ms" + (f"  problems: {bad}" if bad else ""))
    f = res["idemproxy_fds"]
    print(f"  idemproxy open fds: idle {f['idle']}, after each size's runs {f['after_each_size']}")


GROUPS = ("http1", "h2", "ws")
# Runs only when asked for (http1 includes it).
EXTRA_GROUPS = ("big",)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk, h2load and ws-bench run")
    ap.add_argument("--rate", type=int, default=0,
                    help="request rate for the open-loop latency runs (default: 40 %% of nginx's maximum)")
    ap.add_argument("--bin", help="an idemproxy binary to measure instead of building this checkout's")
    ap.add_argument("--pin", action="store_true",
                    help="the proxy under test (one worker) on CPU 1; wrk, the upstream and Redis on CPU 0")
    ap.add_argument("--floors", action="store_true",
                    help="with http1: measure bench/floor.py's pass-through and replay floors in the same run")
    ap.add_argument("--svg", help="chart (default bench/results/latest.svg, latest-pinned.svg with --pin)")
    ap.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups: http1, h2, ws, big")
    ap.add_argument("--json", help="results file (default latest.json, or latest-<groups>.json with --only)")
    ap.add_argument("--h2-clients", type=int, default=16, help="h2load -c: HTTP/2 connections")
    ap.add_argument("--h2-streams", type=int, default=4, help="h2load -m: streams in flight per connection")
    ap.add_argument("--ws-connections", type=int, default=64, help="WebSocket connections")
    ap.add_argument("--ws-sizes", default="1024,65536", help="WebSocket message sizes, bytes")
    args = ap.parse_args()
    groups = [g for g in GROUPS + EXTRA_GROUPS if g in args.only.split(",")]
    if "http1" in groups and "big" in groups:
        groups.remove("big")
    if not groups or set(args.only.split(",")) - set(GROUPS + EXTRA_GROUPS):
        sys.exit(f"--only takes a comma-separated list of {', '.join(GROUPS + EXTRA_GROUPS)}")

    tools = {"nginx": "apt-get install nginx-light", "redis-server": "apt-get install redis-server",
             "cargo": "rustup"}
    if "http1" in groups:
        tools.update({"wrk": "apt-get install wrk", "oha": "cargo install oha --locked"})
    if "big" in groups:
        tools["wrk"] = "apt-get install wrk"
    if "h2" in groups:
        tools["h2load"] = "apt-get install nghttp2-client"
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        sys.exit("missing " + ", ".join(missing) + ": " + "; ".join(dict.fromkeys(tools[t] for t in missing)))
    nginx_h2 = nginx_has_http2()
    if args.bin:
        idem_bin = os.path.abspath(args.bin)
    else:
        subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
        idem_bin = os.path.join(ROOT, "target", "release", "idemproxy")
    ws_bin = None
    if "ws" in groups:
        # A crate of its own (not in the proxy's build), into the same target directory.
        target = os.path.join(ROOT, "target")
        subprocess.run(["cargo", "build", "--release", "--manifest-path",
                        os.path.join(ROOT, "bench", "ws-bench", "Cargo.toml"), "--target-dir", target],
                       cwd=ROOT, check=True)
        ws_bin = os.path.join(target, "release", "ws-bench")

    floor_bin = None
    if args.floors and "http1" in groups:
        subprocess.run(["cargo", "build", "--release", "--example", "hyper_floor"], cwd=ROOT, check=True)
        floor_bin = os.path.join(ROOT, "target", "release", "examples", "hyper_floor")
    if args.pin:
        if os.cpu_count() < 2 or not shutil.which("taskset"):
            sys.exit("--pin needs two CPUs and taskset (util-linux)")
        LOAD[:] = ["taskset", "-c", LOAD_CPU]
    workdir = tempfile.mkdtemp(prefix="idemproxy-bench-")
    stack = Stack(workdir, pin=args.pin)
    results = {}
    try:
        stack.start(idem_bin, groups, h2=nginx_h2, ws_bin=ws_bin)
        if floor_bin:
            stack.start_floors(floor_bin)
        if "http1" in groups:
            results.update(run_http1(stack, args, workdir))
        if "big" in groups:
            results["big"] = run_big(stack, args, workdir)
        if "h2" in groups:
            results["h2"] = run_h2(stack, args, nginx_h2)
        if "ws" in groups:
            results["ws"] = run_ws(stack, args, ws_bin)
    finally:
        stack.stop()
        logs = stack.logs()
        shutil.rmtree(workdir, ignore_errors=True)

    if "http1" in groups:
        report_http1(results, args)
    if "big" in groups:
        print()
        report_big(results["big"])
    if "h2" in groups:
        report_h2(results["h2"])
    if "ws" in groups:
        report_ws(results["ws"])
    if logs:
        print()
        print("logs (idemproxy at RUST_LOG=warn, nginx error logs):")
        for name, text in logs.items():
            lines = text.splitlines()
            print(f"  {name}: {len(lines)} lines; first: {lines[0][:300]}")
    results.update({"reps": args.reps, "duration_s": args.duration, "pin": args.pin, "groups": groups,
                    "logs": {name: text.splitlines()[:20] for name, text in logs.items()}})
    if args.json:
        path = args.json
    else:
        name = "latest" if groups == list(GROUPS) else f"latest-{'-'.join(groups)}"
        name += "-pinned.json" if args.pin else ".json"
        path = os.path.join(ROOT, "bench", "results", name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {path}")
    if "http1" in groups:
        chart_http1(results, args.svg or os.path.join(
            ROOT, "bench", "results", "latest-pinned.svg" if args.pin else "latest.svg"))


if __name__ == "__main__":
    main()
