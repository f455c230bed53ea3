#!/usr/bin/env python3
"""What tracing costs: idemproxy's CPU per request, before tracing / off / on.

Starts, on loopback ports of its own: an nginx-light upstream answering a fixed
1 KiB JSON body, an OTLP/gRPC receiver, and three idemproxy processes (release
builds) side by side, each with a redis-server of its own:

  - "before": the build before tracing was added (commit 9c8822e; built with
    `git worktree add /tmp/idem-before 9c8822e` and `cargo build --release`
    there, CARGO_TARGET_DIR=target/before); skipped if --before-binary is absent;
  - "off": this build, no [telemetry];
  - "on": this build, `[telemetry] otlp_endpoint` at the receiver, sample_ratio 1.0;
  - "on@0.1": the same at sample_ratio 0.1 (a ratio a busy service would run);

Then, in every repetition, rotating which goes first, drives each (one after
the other) with wrk:

  - protected POSTs with a new key per request (reserve, forward, complete);
  - replays of 1,000 stored keys;
  - pass-through GETs (no route protects GET);

and reads the proxy's CPU time (utime + stime of all its threads, export
thread included, from /proc/<pid>/stat) before the run and after it plus a
settle of a little over the exporter's batch delay (so the last batch's
export is counted). Prints CPU microseconds per request for each, and the
paired ratios off/before and on/off of each repetition, as medians with
min-max.

The receiver: by default ("sink") a minimal OTLP/gRPC TraceService that takes
each Export's bytes undecoded and answers success, so that it keeps up; with
--receiver full, tests/peers/otlp_receiver.py (decodes every span and writes it
as JSON, here to /dev/null). Either way the "on" proxy's
idemproxy_spans_dropped_total is read after every run and printed; a run that
dropped spans is flagged (its cost would look lower than it is).

    bench/telemetry.py [--reps 5] [--duration 3] [--connections 32]
                       [--before-binary target/before/release/idemproxy]
                       [--python target/peers-venv/bin/python] [--receiver sink|full]

Needs: nginx (nginx-light), wrk, redis-server, cargo, and a Python with grpcio
and opentelemetry-proto (python3 -m venv target/peers-venv &&
target/peers-venv/bin/python -m pip install 'grpcio~=1.85' 'opentelemetry-proto~=1.45' protobuf).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import free_port, wait_http, wait_port  # noqa: E402
from sealing import (NEWKEY_LUA, REPLAY_KEYS, REPLAY_LUA, REQUEST, Stack as SealingStack,  # noqa: E402
                     cpu_seconds, metric, post, start_wrk, wrk_requests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BEFORE = os.path.join(ROOT, "target", "before", "release", "idemproxy")
DEFAULT_PYTHON = os.path.join(ROOT, "target", "peers-venv", "bin", "python")
RECEIVER = os.path.join(ROOT, "tests", "peers", "otlp_receiver.py")
# The exporter sends a batch not full after 1 s (src/telemetry.rs DELAY).
SETTLE = 1.3
DROPPED = "idemproxy_spans_dropped_total"
# Spans a request of each kind makes (docs/telemetry.md#spans).
SPANS = {"newkey": 4, "replay": 2, "get": 2}

GET_LUA = r"""
request = function() return wrk.format("GET", "/v1/payments/pay_1") end
"""

# A TraceService that does not decode: the request's bytes are counted and
# discarded, and success is answered (an empty ExportTraceServiceResponse is
# zero bytes). Writes {"listening": port} first, then, on SIGTERM, its counts.
SINK = r"""
import json, os, signal, sys, threading
from concurrent import futures
import grpc

lock = threading.Lock()
counts = {"exports": 0, "bytes": 0}

def export(request, context):
    with lock:
        counts["exports"] += 1
        counts["bytes"] += len(request)
    return b""

handler = grpc.method_handlers_generic_handler(
    "opentelemetry.proto.collector.trace.v1.TraceService",
    {"Export": grpc.unary_unary_rpc_method_handler(export)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(json.dumps({"listening": port}), flush=True)

def stop(*_):
    with open(sys.argv[1], "w") as f:
        json.dump(counts, f)
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
signal.pause()
"""


class Stack(SealingStack):
    """sealing.py's stack (nginx upstream, a redis-server per proxy), with a
    [telemetry] section for the proxy that traces, and an OTLP receiver."""

    def start_receiver(self, python, kind):
        if kind == "sink":
            script = os.path.join(self.dir, "sink.py")
            with open(script, "w") as f:
                f.write(SINK)
            args = [python, script, os.path.join(self.dir, "sink.json")]
        else:
            args = [python, RECEIVER, "--out", os.devnull]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        line = p.stdout.readline()
        if not line:
            sys.exit(f"the OTLP receiver did not start ({python} {args[1]}): needs grpcio and opentelemetry-proto")
        self.receiver = p
        self.otlp_port = json.loads(line)["listening"]
        wait_port(self.otlp_port)

    def start_proxy(self, name, idem_bin, telemetry):
        redis_port, port, admin = free_port(), free_port(), free_port()
        self.spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", self.dir])
        wait_port(redis_port)
        tele = ""
        if telemetry is not None:
            tele = f"""
[telemetry]
otlp_endpoint = "http://127.0.0.1:{self.otlp_port}"
sample_ratio = {telemetry}
"""
        cfg = os.path.join(self.dir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
upstream = "http://127.0.0.1:{self.up_port}"

[store]
backend = "redis"
url = "redis://127.0.0.1:{redis_port}/0"
{tele}
[[routes]]
name = "payments"
path = "/v1/payments"
""")
        # No per-request log lines; and no OTEL_* from this environment (they
        # would turn tracing on for "off").
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["RUST_LOG"] = "warn"
        proc = self.spawn([idem_bin, "--config", cfg], env=env)
        wait_port(port)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.proxies[name] = {"proc": proc, "port": port, "admin": admin, "redis": redis_port}


def export_thread_seconds(pid):
    """utime + stime of the proxy's span export thread (named otel-export); 0 without one."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "otel-export":
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def measure(stack, name, duration, connections, script, path):
    """One wrk run against one proxy: CPU microseconds per request (all
    threads, and the export thread's part), requests per second, requests."""
    pid = stack.proxies[name]["proc"].pid
    before, export_before = cpu_seconds(pid), export_thread_seconds(pid)
    proc = start_wrk(stack.url(name, path), duration, connections, script)
    requests = wrk_requests(proc, name)
    time.sleep(SETTLE)  # the exporter's last batch, for "on"; the same wait for all
    used = cpu_seconds(pid) - before
    exported = export_thread_seconds(pid) - export_before
    return used * 1e6 / requests, exported * 1e6 / requests, requests / duration, requests


def outcome_count(stack, name, outcome):
    """idemproxy_requests_total for one outcome, all routes."""
    url = f"http://127.0.0.1:{stack.proxies[name]['admin']}/metrics"
    text = urllib.request.urlopen(url).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("idemproxy_requests_total{") and f'outcome="{outcome}"' in line)


def fmt(values):
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


def fmt_ratio(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--before-binary", default=DEFAULT_BEFORE,
                    help="idemproxy built from 9c8822e, before tracing (default: %(default)s)")
    ap.add_argument("--python", default=DEFAULT_PYTHON,
                    help="a Python with grpcio and opentelemetry-proto, for the receiver (default: %(default)s)")
    ap.add_argument("--receiver", choices=("sink", "full"), default="sink",
                    help="sink: discards exports undecoded (default); full: tests/peers/otlp_receiver.py")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "redis-server", "cargo"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install nginx-light wrk redis-server")
    if not os.path.exists(args.python):
        sys.exit(f"missing {args.python}: python3 -m venv target/peers-venv && target/peers-venv/bin/python "
                 "-m pip install 'grpcio~=1.85' 'opentelemetry-proto~=1.45' protobuf")
    subprocess.run(["cargo", "build", "--quiet", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    idem_bin = os.path.join(target, "release", "idemproxy")
    names = ["before", "off", "on", "on@0.1"]
    ratios = {"on": 1.0, "on@0.1": 0.1}
    if not os.path.exists(args.before_binary):
        print(f"no {args.before_binary}: skipping \"before\" (build 9c8822e with CARGO_TARGET_DIR=target/before)",
              file=sys.stderr)
        names.remove("before")
    binaries = {"before": args.before_binary, "off": idem_bin, "on": idem_bin, "on@0.1": idem_bin}
    kinds = (("newkey", "new key (POST)"), ("replay", "replay (POST)"), ("get", "pass-through GET"))

    workdir = tempfile.mkdtemp(prefix="idemproxy-telemetry-")
    stack = Stack(workdir)
    cpu = {(k, n): [] for k, _ in kinds for n in names}
    rps = {(k, n): [] for k, _ in kinds for n in names}
    drops = []  # (rep, kind, spans dropped in that run) for "on"
    export = {k: [] for k, _ in kinds}  # the export thread's CPU per request, for "on"
    try:
        stack.start_upstream()
        stack.start_receiver(args.python, args.receiver)
        for name in names:
            stack.start_proxy(name, binaries[name], telemetry=ratios.get(name))
            for i in range(1, REPLAY_KEYS + 1):
                status, _, body = post(stack.url(name), f"replay-{i}")
                assert status == 201 and len(body) == 1024, (status, len(body))
            status, replayed, body = post(stack.url(name), "replay-1")
            assert replayed == "true" and len(body) == 1024
        replay = os.path.join(workdir, "replay.lua")
        with open(replay, "w") as f:
            f.write(REPLAY_LUA % (REPLAY_KEYS, REQUEST))
        get = os.path.join(workdir, "get.lua")
        with open(get, "w") as f:
            f.write(GET_LUA)
        for rep in range(-1, args.reps):  # rep -1: warm-up, not counted
            shift = rep % len(names)
            order = names[shift:] + names[:shift]
            for kind, _ in kinds:
                for name in order:
                    script, path = replay, "/v1/payments"
                    if kind == "get":
                        script, path = get, "/v1/payments/pay_1"
                    elif kind == "newkey":
                        script = os.path.join(workdir, f"newkey-{name}-{rep}.lua")
                        with open(script, "w") as f:
                            f.write(NEWKEY_LUA % (f"k{time.time_ns()}", REQUEST))
                    dropped0 = metric(stack, "on", DROPPED) if name == "on" else 0.0
                    per_request, exporting, rate, _ = measure(stack, name, args.duration, args.connections,
                                                              script, path)
                    if name == "on" and rep >= 0:
                        export[kind].append(exporting)
                    if name == "on":
                        dropped = metric(stack, "on", DROPPED) - dropped0
                        if rep >= 0:
                            drops.append((rep + 1, kind, dropped))
                        if dropped:
                            print(f"FLAGGED: {f'rep {rep + 1}' if rep >= 0 else 'warm-up'} {kind}: \"on\" dropped {dropped:.0f} spans",
                                  file=sys.stderr)
                    if rep >= 0:
                        cpu[(kind, name)].append(per_request)
                        rps[(kind, name)].append(rate)
            if rep >= 0:
                line = ", ".join(f"{kind} " + " / ".join(f"{cpu[(kind, n)][-1]:.1f}" for n in names)
                                 for kind, _ in kinds)
                print(f"rep {rep + 1}/{args.reps} (order {' '.join(order)}): {line} us "
                      f"({' / '.join(names)})", file=sys.stderr)
        outcomes = {n: {o: outcome_count(stack, n, o) for o in ("forwarded", "replayed", "passthrough")}
                    for n in names}
        dropped_total = metric(stack, "on", DROPPED)
        for name in ("off", "before"):
            if name in names and metric(stack, name, DROPPED):
                print(f"FLAGGED: \"{name}\" reports dropped spans", file=sys.stderr)
    finally:
        stack.stop()
        sink = {}
        try:
            with open(os.path.join(workdir, "sink.json")) as f:
                sink = json.load(f)
        except OSError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(f"idemproxy CPU per request (utime+stime, all threads), 1 KiB answers, {args.reps} repetitions of "
          f"{args.duration} s each, one proxy at a time, order rotated; wrk -t1 -c{args.connections}; "
          f"each run's CPU read {SETTLE} s after wrk ends; medians (min-max)")
    print(f"\"on\": sample_ratio 1.0 (\"on@0.1\": 0.1), OTLP/gRPC to the {args.receiver} receiver"
          + (" (undecoding sink)" if args.receiver == "sink" else " (tests/peers/otlp_receiver.py)"))
    if "before" not in names:
        print("\"before\" skipped: no binary at " + args.before_binary)
    print()
    cols = ([f"{n}, us/req" for n in names] + (["off / before"] if "before" in names else [])
            + ["on / off", "on@0.1 / off"])
    print("| " + " | ".join([f"{'kind':18}"] + [f"{c:21}" for c in cols]) + " |")
    print("|" + "|".join(["-" * 20] + ["-" * 23] * len(cols)) + "|")
    for kind, label in kinds:
        cells = [fmt(cpu[(kind, n)]) for n in names]
        if "before" in names:
            cells.append(fmt_ratio([o / b for b, o in zip(cpu[(kind, "before")], cpu[(kind, "off")])]))
        for on in ("on", "on@0.1"):
            cells.append(fmt_ratio([n / o for o, n in zip(cpu[(kind, "off")], cpu[(kind, on)])]))
        print("| " + " | ".join([f"{label:18}"] + [f"{c:21}" for c in cells]) + " |")
    print()
    print("targets: off / before within noise (~1.0); on / off <= 1.15")
    print()
    print("\"on\" split: the request path (all threads but otel-export) and the export thread "
          "(OTLP encoding and sending), us/req; spans per request: new key 4 (SERVER, reserve, "
          "CLIENT, complete), replay 2 (SERVER, reserve), GET 2 (SERVER, CLIENT)")
    print("| " + " | ".join([f"{'kind':18}"] + [f"{c:21}" for c in ("off", "on: request path", "on: export thread",
                                                                     "export, us/span")]) + " |")
    print("|" + "|".join(["-" * 20] + ["-" * 23] * 4) + "|")
    for kind, label in kinds:
        spans = SPANS[kind]
        path_cpu = [t - e for t, e in zip(cpu[(kind, "on")], export[kind])]
        cells = [fmt(cpu[(kind, "off")]), fmt(path_cpu), fmt(export[kind]), fmt([e / spans for e in export[kind]])]
        print("| " + " | ".join([f"{label:18}"] + [f"{c:21}" for c in cells]) + " |")
    for kind, label in kinds:
        print(f"throughput, {label}: " + ", ".join(f"{n} {statistics.median(rps[(kind, n)]):.0f}/s" for n in names)
              + " (medians; not the subject here)")
    flagged = [d for d in drops if d[2]]
    print(f"spans dropped by \"on\": {dropped_total:.0f} in all (warm-up included); per measured run: "
          + ", ".join(f"r{r} {k} {d:.0f}" for r, k, d in drops)
          + (f"  -- FLAGGED: {len(flagged)} measured run(s) dropped spans" if flagged else "  (none flagged)"))
    if sink:
        print(f"receiver took {sink['exports']} exports, {sink['bytes'] / 1e6:.1f} MB")
    print("checks (requests by outcome): " + "; ".join(
        f"{n} " + " ".join(f"{o}={c:.0f}" for o, c in outcomes[n].items()) for n in names))


if __name__ == "__main__":
    main()
