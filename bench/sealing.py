#!/usr/bin/env python3
"""What sealing records at rest costs: idemproxy's CPU per request, sealing off vs on.

Starts, on loopback ports of its own: an nginx-light upstream answering a fixed
1 KiB JSON body, two redis-servers, and two idemproxy processes (release
build) side by side, one per redis-server: one without `encryption_key_file`
(off) and one with it (on). Then, in every repetition and alternating which
goes first, drives each with wrk:

  - protected POSTs with a new key per request (reserve, forward, seal, complete);
  - replays of 1,000 stored keys (reserve finds the record, open, replay);

and reads the proxy's CPU time (utime + stime from /proc/<pid>/stat) before
and after each run. Prints CPU microseconds per request for each, and the
ratio on/off of each repetition (paired: the machine is noisy), as medians
with min-max. Also checks, untimed, that the "on" proxy's records are stored
in format 3 (sealed) and that the replays were replays. Last, the in-process
cost of sealing and opening one 1 KiB answer, without the network around it
(`cargo run --release --example seal_cost`).

    bench/sealing.py [--reps 7] [--duration 5] [--connections 32] [--together]

With --together both proxies are driven at the same time in each repetition
(each with its own wrk), so that both see the same moment of a noisy machine.

Needs: nginx (nginx-light), wrk, redis-server, redis-cli, cargo.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import free_port, stop_all, wait_http, wait_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A 1 KiB answer (1,024 bytes exactly).
BODY = '{"id":"pay_1","status":"succeeded","pad":"' + "x" * (1024 - 44) + '"}'
assert len(BODY) == 1024
REQUEST = '{"amount":4200}'
# A key made as the README says (head -c 32 /dev/urandom | base64); a bench key only.
KEY_LINE = "bench-1:" + "QmVuY2htYXJrIGtleSwgbm90IGEgc2VjcmV0ISEhISE="

NEWKEY_LUA = r"""
local counter, threads, prefix = 0, 0, ""
function setup(thread) threads = threads + 1; thread:set("id", threads) end
function init(args) prefix = "%s-" .. tostring(id) .. "-" end
request = function()
  counter = counter + 1
  return wrk.format("POST", "/v1/payments",
    {["Idempotency-Key"] = prefix .. counter, ["Content-Type"] = "application/json"}, '%s')
end
"""

REPLAY_LUA = r"""
request = function()
  return wrk.format("POST", "/v1/payments",
    {["Idempotency-Key"] = "replay-" .. math.random(1, %d), ["Content-Type"] = "application/json"}, '%s')
end
"""

REPLAY_KEYS = 1000


class Stack:
    def __init__(self, workdir):
        self.dir = workdir
        self.procs = []
        self.up_port = free_port()
        self.proxies = {}

    def spawn(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def start_upstream(self):
        conf = os.path.join(self.dir, "upstream.conf")
        with open(conf, "w") as f:
            f.write(f"""worker_processes 1;
daemon off;
pid {self.dir}/upstream.pid;
error_log {self.dir}/upstream.err warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  client_body_temp_path {self.dir}/body;
  server {{
    listen 127.0.0.1:{self.up_port} backlog=4096;
    default_type application/json;
    location / {{ add_header Location /v1/payments/pay_1; return 201 '{BODY}'; }}
  }}
}}
""")
        self.spawn(["nginx", "-c", conf])
        wait_port(self.up_port)

    def start_proxy(self, name, idem_bin, sealed):
        redis_port, port, admin = free_port(), free_port(), free_port()
        self.spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", self.dir])
        wait_port(redis_port)
        store = ""
        if sealed:
            keys = os.path.join(self.dir, "record-keys")
            with open(keys, "w") as f:
                f.write(KEY_LINE + "\n")
            store = f'encryption_key_file = "{keys}"\n'
        cfg = os.path.join(self.dir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
upstream = "http://127.0.0.1:{self.up_port}"

[store]
backend = "redis"
url = "redis://127.0.0.1:{redis_port}/0"
{store}
[[routes]]
name = "payments"
path = "/v1/payments"
""")
        # No per-request log lines, as in bench.py.
        proc = self.spawn([idem_bin, "--config", cfg], env=dict(os.environ, RUST_LOG="warn"))
        wait_port(port)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.proxies[name] = {"proc": proc, "port": port, "admin": admin, "redis": redis_port}

    def url(self, name, path="/v1/payments"):
        return f"http://127.0.0.1:{self.proxies[name]['port']}{path}"

    def stop(self):
        stop_all(self.procs)


def cpu_seconds(pid):
    """utime + stime of a process, in seconds (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def start_wrk(url, duration, connections, script):
    return subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "-s", script, url],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wrk_requests(proc, name):
    out, _ = proc.communicate()
    if proc.returncode:
        sys.exit(f"wrk failed against {name}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        print(f"warning: {name}: {non2xx.group(1)} answers were not 2xx", file=sys.stderr)
    return int(re.search(r"(\d+) requests in", out).group(1))


def measured(stack, names, duration, connections, scripts):
    """Runs wrk against each proxy in `names` at the same time; returns, for each,
    CPU microseconds per request and requests per second."""
    pids = {n: stack.proxies[n]["proc"].pid for n in names}
    before = {n: cpu_seconds(pids[n]) for n in names}
    procs = {n: start_wrk(stack.url(n), duration, connections, scripts[n]) for n in names}
    requests = {n: wrk_requests(procs[n], n) for n in names}
    used = {n: cpu_seconds(pids[n]) - before[n] for n in names}
    return {n: (used[n] * 1e6 / requests[n], requests[n] / duration) for n in names}


def post(url, key):
    req = urllib.request.Request(url, data=REQUEST.encode(), method="POST",
                                 headers={"Idempotency-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        body = r.read()
        return r.status, r.headers.get("Idempotent-Replayed"), body


def metric(stack, name, series):
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.proxies[name]['admin']}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def stored_version(stack, name):
    """The format version byte of one stored record (3 = sealed)."""
    port = str(stack.proxies[name]["redis"])
    key = subprocess.run(["redis-cli", "-p", port, "RANDOMKEY"], capture_output=True, text=True,
                         check=True).stdout.strip()
    raw = subprocess.run(["redis-cli", "-p", port, "--raw", "GETRANGE", key, "0", "0"], capture_output=True,
                         check=True).stdout
    return raw[0]


def fmt(values):
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--together", action="store_true",
                    help="drive both proxies at the same time in each repetition, rather than one after the other")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "redis-server", "redis-cli", "cargo"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install nginx-light wrk redis-server")
    subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    idem_bin = os.path.join(target, "release", "idemproxy")

    workdir = tempfile.mkdtemp(prefix="idemproxy-sealing-")
    stack = Stack(workdir)
    names = ("off", "on")
    cpu = {(s, n): [] for s in ("newkey", "replay") for n in names}
    rps = {(s, n): [] for s in ("newkey", "replay") for n in names}
    try:
        stack.start_upstream()
        for name in names:
            stack.start_proxy(name, idem_bin, sealed=name == "on")
            for i in range(1, REPLAY_KEYS + 1):
                status, _, body = post(stack.url(name), f"replay-{i}")
                assert status == 201 and len(body) == 1024, (status, len(body))
            status, replayed, body = post(stack.url(name), "replay-1")
            assert replayed == "true" and len(body) == 1024
        versions = {n: stored_version(stack, n) for n in names}
        assert versions == {"off": 1, "on": 3}, versions
        replay = os.path.join(workdir, "replay.lua")
        with open(replay, "w") as f:
            f.write(REPLAY_LUA % (REPLAY_KEYS, REQUEST))
        for rep in range(-1, args.reps):  # rep -1: warm-up, not counted
            order = names if rep % 2 == 0 else tuple(reversed(names))
            for scenario in ("newkey", "replay"):
                scripts = {}
                for name in names:
                    scripts[name] = replay
                    if scenario == "newkey":
                        scripts[name] = os.path.join(workdir, f"newkey-{name}-{rep}.lua")
                        with open(scripts[name], "w") as f:
                            f.write(NEWKEY_LUA % (f"k{time.time_ns()}", REQUEST))
                # Interleaved (one after the other, alternating which goes first), or together.
                runs = [names] if args.together else [(name,) for name in order]
                for run in runs:
                    for name, (per_request, rate) in measured(stack, run, args.duration, args.connections,
                                                              scripts).items():
                        if rep >= 0:
                            cpu[(scenario, name)].append(per_request)
                            rps[(scenario, name)].append(rate)
            if rep >= 0:
                print(f"rep {rep + 1}/{args.reps}: new key {cpu[('newkey', 'off')][-1]:.1f} / "
                      f"{cpu[('newkey', 'on')][-1]:.1f} us, replay {cpu[('replay', 'off')][-1]:.1f} / "
                      f"{cpu[('replay', 'on')][-1]:.1f} us (off / on)", file=sys.stderr)
        replayed = {n: metric(stack, n, 'idemproxy_requests_total{route="payments",outcome="replayed"}')
                    for n in names}
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    how = "both at once" if args.together else "one after the other, alternating which goes first"
    print(f"idemproxy CPU per request (utime+stime), 1 KiB answers, {args.reps} paired repetitions of "
          f"{args.duration} s ({how}), wrk -t1 -c{args.connections}; medians (min-max)")
    print()
    print(f"| {'scenario':22} | {'sealing off, us/req':22} | {'sealing on, us/req':22} | "
          f"{'on / off (paired)':22} | target |")
    print(f"|{'-' * 24}|{'-' * 24}|{'-' * 24}|{'-' * 24}|--------|")
    for scenario, label in (("newkey", "new key (POST)"), ("replay", "replay")):
        off, on = cpu[(scenario, "off")], cpu[(scenario, "on")]
        ratios = [b / a for a, b in zip(off, on)]
        ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"| {label:22} | {fmt(off):22} | {fmt(on):22} | {ratio:22} | <= 1.10 |")
    print()
    for scenario, label in (("newkey", "new key"), ("replay", "replay")):
        print(f"throughput, {label}: off {statistics.median(rps[(scenario, 'off')]):.0f}/s, "
              f"on {statistics.median(rps[(scenario, 'on')]):.0f}/s (medians; not the subject here)")
    print(f"checks: stored format off={versions['off']} on={versions['on']} (3 = sealed); "
          f"replays counted off={replayed['off']:.0f} on={replayed['on']:.0f}")
    cost = subprocess.run(["cargo", "run", "--release", "--example", "seal_cost"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip().splitlines()
    print("in process (examples/seal_cost.rs, last of 3 rounds): " + cost[-1].split(": ", 1)[1])


if __name__ == "__main__":
    main()
