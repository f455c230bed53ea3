#!/usr/bin/env python3
"""What tracing costs: idemproxy's CPU per request, tracing off vs on, the proxy alone on its CPU.

Starts, on loopback ports of its own: an nginx-light upstream answering a fixed
1 KiB JSON body, an OTLP/gRPC receiver, and one idemproxy process per variant,
side by side, each with a redis-server of its own. Every idemproxy runs under
`taskset -c 1`, alone on CPU 1; everything else (nginx, the redis-servers, the
receiver, wrk) under `taskset -c 0`, and this script, once the build is done,
on CPU 0 too (sched_setaffinity). The variants, by name:

  - "off": this build (the `cargo build --release` the script does), no [telemetry];
  - "off-2": a second, identical "off": its ratio to "off" is the noise floor;
  - "unsampled": this build, tracing on at `sample_ratio = 0.0` (wrk sends no
    traceparent, so every request is an unsampled root);
  - "0.1", "1.0": this build at `sample_ratio` 0.1 and 1.0;
  - any `--variant NAME=PATH@RATIO` (another binary; RATIO a sample_ratio, or
    "off" for no [telemetry]); skipped, with a message, when PATH does not exist.
    E.g. the two comparison builds of baedbf0, the last build with the
    OpenTelemetry SDK's spans: "sdk-spans+own-queue" (that commit as is) and
    "sdk-batch" (that commit with bench/results/sdk-batch.patch applied: the
    SDK's BatchSpanProcessor in place of our queue and export thread):

      git worktree add --detach /tmp/sdk baedbf0 && cd /tmp/sdk
      CARGO_TARGET_DIR=/tmp/sdk-target cargo build --release --bin idemproxy
      cp /tmp/sdk-target/release/idemproxy /tmp/sdk-spans-own-queue
      git apply bench/results/sdk-batch.patch  # (the patch from this checkout)
      CARGO_TARGET_DIR=/tmp/sdk-target cargo build --release --bin idemproxy
      cp /tmp/sdk-target/release/idemproxy /tmp/sdk-batch
      bench/telemetry.py --variant sdk-spans+own-queue=/tmp/sdk-spans-own-queue@1.0 \
                         --variant sdk-batch=/tmp/sdk-batch@1.0

Then, in every repetition, rotating which goes first, drives each variant
(one after the other) with wrk:

  - protected POSTs with a new key per request (reserve, forward, complete);
  - replays of 1,000 stored keys;
  - pass-through GETs (no route protects GET);

and reads the proxy's CPU time (utime + stime of all its threads, from
/proc/<pid>/stat) before the run and after it plus a settle of a little over
the exporter's batch delay (so the last batch's export is counted); also the
part of it spent by the export threads (/proc/<pid>/task/*: ours is named
`otel-export`; the SDK's BatchSpanProcessor thread `OpenTelemetry.Traces.BatchProcessor`,
`OpenTelemetry.T` once cut to 15 characters). Prints, per scenario, a table of
CPU microseconds per request, the ratio to "off" of the same repetition
(paired), and the export threads' microseconds per request, as medians with
min-max; then the targets with PASS/FAIL for the medians.

The receiver: by default ("sink") a minimal OTLP/gRPC TraceService, one port
per traced variant, that counts each Export's requests, bytes and spans (a
walk of the protobuf's outer fields, spans not decoded) and answers success,
so that it keeps up; with --receiver full, one tests/peers/otlp_receiver.py
per traced variant (decodes every span and writes it as JSON, here to
/dev/null). Every traced variant's idemproxy_spans_dropped_total is read
before and after each of its runs: a run that dropped spans is FLAGGED (its
cost would look lower than it is).

    bench/telemetry.py [--reps 5] [--duration 3] [--connections 32]
                       [--variant NAME=PATH@RATIO ...]
                       [--python target/peers-venv/bin/python] [--receiver sink|full]

Needs: 2 CPUs or more, taskset (util-linux), nginx (nginx-light), wrk,
redis-server, cargo, and a Python with grpcio and opentelemetry-proto
(python3 -m venv target/peers-venv && target/peers-venv/bin/python -m pip
install 'grpcio~=1.85' 'opentelemetry-proto~=1.45' protobuf).
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import free_port, wait_http, wait_port  # noqa: E402
from sealing import (NEWKEY_LUA, REPLAY_KEYS, REPLAY_LUA, REQUEST, Stack as SealingStack,  # noqa: E402
                     cpu_seconds, metric, post, wrk_requests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(ROOT, "target", "peers-venv", "bin", "python")
RECEIVER = os.path.join(ROOT, "tests", "peers", "otlp_receiver.py")
# The proxies' CPU, and everything else's.
PROXY_CPU, LOAD_CPU = 1, 0
# Both exporters send a batch not full after 1 s (src/telemetry.rs DELAY; the
# SDK batch processor's scheduled_delay as the comparison build sets it).
SETTLE = 1.3
DROPPED = "idemproxy_spans_dropped_total"
# The threads that export spans, by /proc/<pid>/task/<tid>/comm (cut to 15
# characters): ours (src/telemetry.rs); the SDK's BatchSpanProcessor thread
# (opentelemetry_sdk 0.33 src/trace/span_processor.rs,
# "OpenTelemetry.Traces.BatchProcessor").
EXPORT_THREADS = ("otel-export", "OpenTelemetry.Traces.BatchProcessor"[:15])
# Spans a request of each kind makes (docs/telemetry.md#spans).
SPANS = {"newkey": 4, "replay": 2, "get": 2}
KINDS = (("newkey", "new key (POST)"), ("replay", "replay (POST)"), ("get", "pass-through GET"))
# The targets: ratio to "off" (median) at a sample_ratio; 0.0 is "within noise".
TARGETS = {0.1: 1.08, 1.0: 1.6}

GET_LUA = r"""
request = function() return wrk.format("GET", "/v1/payments/pay_1") end
"""

# A TraceService per traced variant (one port each) that does not decode:
# each request's bytes are counted, and its spans (ExportTraceServiceRequest
# field 1 ResourceSpans, its field 2 ScopeSpans, its field 2 Span: only the
# keys and lengths are read), and success is answered (an empty
# ExportTraceServiceResponse is zero bytes). Writes {"listening": {name: port}}
# first, then, on SIGTERM, its counts to argv[1].
SINK = r"""
import json, os, signal, sys, threading
from concurrent import futures
import grpc

def varint(b, i):
    shift = value = 0
    while True:
        c = b[i]
        i += 1
        value |= (c & 0x7F) << shift
        if c < 0x80:
            return value, i
        shift += 7

def fields(b, start, end, wanted):
    # (start, end) of each length-delimited field numbered `wanted`.
    i = start
    while i < end:
        key, i = varint(b, i)
        wire = key & 7
        if wire == 2:
            n, i = varint(b, i)
            if key >> 3 == wanted:
                yield i, i + n
            i += n
        elif wire == 0:
            _, i = varint(b, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(wire)

def spans(b):
    return sum(1 for rs in fields(b, 0, len(b), 1) for ss in fields(b, *rs, 2) for _ in fields(b, *ss, 2))

lock = threading.Lock()
counts = {}
servers = []
ports = {}
for name in sys.argv[2:]:
    counts[name] = {"exports": 0, "bytes": 0, "spans": 0}
    def export(request, context, c=counts[name]):
        n = spans(request)
        with lock:
            c["exports"] += 1
            c["bytes"] += len(request)
            c["spans"] += n
        return b""
    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    ports[name] = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servers.append(server)
print(json.dumps({"listening": ports}), flush=True)

def stop(*_):
    with lock:
        with open(sys.argv[1], "w") as f:
            json.dump(counts, f)
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
signal.pause()
"""


def pinned(cpu, args):
    return ["taskset", "-c", str(cpu)] + list(args)


class Variant:
    def __init__(self, name, binary, ratio, extra=False):
        self.name, self.binary, self.ratio, self.extra = name, binary, ratio, extra

    @property
    def traced(self):
        return self.ratio is not None

    def setting(self):
        return "off" if self.ratio is None else f"sample_ratio {self.ratio:g}"


def parse_variant(text):
    """NAME=PATH@RATIO (RATIO: a sample_ratio, or "off")."""
    m = re.fullmatch(r"([A-Za-z0-9_.+-]+)=(.+)@([^@]+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH@RATIO, e.g. sdk-batch=/tmp/sdk-batch@1.0")
    name, path, ratio = m.groups()
    if ratio == "off":
        return Variant(name, path, None, extra=True)
    try:
        value = float(ratio)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: RATIO must be a number in [0, 1] or \"off\"")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: RATIO must be in [0, 1]")
    return Variant(name, path, value, extra=True)


class Stack(SealingStack):
    """sealing.py's stack (nginx upstream, a redis-server per proxy), pinned:
    the proxies on PROXY_CPU, the rest on LOAD_CPU; a [telemetry] section for
    the traced variants, and an OTLP receiver port for each."""

    def spawn(self, args, proxy=False, stderr=subprocess.DEVNULL, **kw):
        p = subprocess.Popen(pinned(PROXY_CPU if proxy else LOAD_CPU, args), stdout=subprocess.DEVNULL,
                             stderr=stderr, **kw)
        self.procs.append(p)
        return p

    def start_receivers(self, python, kind, names):
        self.otlp_ports = {}
        if not names:
            return
        if kind == "sink":
            script = os.path.join(self.dir, "sink.py")
            with open(script, "w") as f:
                f.write(SINK)
            runs = [(None, [python, script, os.path.join(self.dir, "sink.json")] + names)]
        else:
            runs = [(name, [python, RECEIVER, "--out", os.devnull]) for name in names]
        for name, args in runs:
            p = subprocess.Popen(pinned(LOAD_CPU, args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
            self.procs.append(p)
            line = p.stdout.readline()
            if not line:
                sys.exit(f"the OTLP receiver did not start ({python} {args[1]}): needs grpcio and opentelemetry-proto")
            listening = json.loads(line)["listening"]
            self.otlp_ports.update(listening if name is None else {name: listening})
        for port in self.otlp_ports.values():
            wait_port(port)

    def start_proxy(self, variant):
        name = variant.name
        redis_port, port, admin = free_port(), free_port(), free_port()
        self.spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", self.dir])
        wait_port(redis_port)
        tele = ""
        if variant.traced:
            tele = f"""
[telemetry]
otlp_endpoint = "http://127.0.0.1:{self.otlp_ports[name]}"
sample_ratio = {variant.ratio!r}
"""
        cfg = os.path.join(self.dir, f"proxy-{len(self.proxies)}.toml")
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
        # would turn tracing on for "off", or change the SDK's batch settings).
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["RUST_LOG"] = "warn"
        log = os.path.join(self.dir, f"proxy-{len(self.proxies)}.log")
        with open(log, "w") as err:
            proc = self.spawn([variant.binary, "--config", cfg], proxy=True, env=env, stderr=err)
        end = time.time() + 10
        while not port_open(port):
            if proc.poll() is not None or time.time() > end:
                with open(log) as f:
                    tail = f.read()[-2000:]
                sys.exit(f"variant {name!r} ({variant.binary}) did not start listening:\n{tail}")
            time.sleep(0.05)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.proxies[name] = {"proc": proc, "port": port, "admin": admin, "redis": redis_port}


def port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def export_thread_seconds(pid):
    """utime + stime of the proxy's span export threads (EXPORT_THREADS); 0 without any."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() not in EXPORT_THREADS:
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def thread_names(pid):
    names = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def start_wrk(url, duration, connections, script):
    return subprocess.Popen(pinned(LOAD_CPU, ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "-s", script, url]),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def measure(stack, name, duration, connections, script, path):
    """One wrk run against one proxy: CPU microseconds per request (all
    threads, and the export threads' part), requests per second, requests."""
    pid = stack.proxies[name]["proc"].pid
    before, export_before = cpu_seconds(pid), export_thread_seconds(pid)
    proc = start_wrk(stack.url(name, path), duration, connections, script)
    requests = wrk_requests(proc, name)
    time.sleep(SETTLE)  # the exporter's last batch, for the traced; the same wait for all
    used = cpu_seconds(pid) - before
    exported = export_thread_seconds(pid) - export_before
    return used * 1e6 / requests, exported * 1e6 / requests, requests / duration, requests


def outcome_count(stack, name, outcome):
    """idemproxy_requests_total for one outcome, all routes."""
    url = f"http://127.0.0.1:{stack.proxies[name]['admin']}/metrics"
    text = urllib.request.urlopen(url).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("idemproxy_requests_total{") and f'outcome="{outcome}"' in line)


def med(values):
    return statistics.median(values)


def fmt(values):
    return f"{med(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def fmt_ratio(values):
    return f"{med(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["| " + " | ".join(f"{h:{w}}" for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(f"{c:{w}}" for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=PATH@RATIO",
                    help="another idemproxy binary, traced at sample_ratio RATIO (or \"off\"); repeatable")
    ap.add_argument("--python", default=DEFAULT_PYTHON,
                    help="a Python with grpcio and opentelemetry-proto, for the receiver (default: %(default)s)")
    ap.add_argument("--receiver", choices=("sink", "full"), default="sink",
                    help="sink: counts exports undecoded (default); full: tests/peers/otlp_receiver.py")
    args = ap.parse_args()
    if not shutil.which("taskset"):
        sys.exit("missing taskset: it pins the proxies to their own CPU (apt-get install util-linux)")
    if PROXY_CPU not in os.sched_getaffinity(0) or LOAD_CPU not in os.sched_getaffinity(0):
        sys.exit(f"needs CPUs {LOAD_CPU} and {PROXY_CPU} (the proxies alone on {PROXY_CPU}); "
                 f"this process may use {sorted(os.sched_getaffinity(0))}")
    for tool in ("nginx", "wrk", "redis-server", "cargo"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install nginx-light wrk redis-server")
    if not os.path.exists(args.python):
        sys.exit(f"missing {args.python}: python3 -m venv target/peers-venv && target/peers-venv/bin/python "
                 "-m pip install 'grpcio~=1.85' 'opentelemetry-proto~=1.45' protobuf")
    subprocess.run(["cargo", "build", "--quiet", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    idem_bin = os.path.join(target, "release", "idemproxy")
    # The build used both CPUs; from here this script (and what it starts
    # without taskset) stays off the proxies' CPU.
    os.sched_setaffinity(0, {LOAD_CPU})

    variants = [Variant("off", idem_bin, None), Variant("off-2", idem_bin, None),
                Variant("unsampled", idem_bin, 0.0), Variant("0.1", idem_bin, 0.1), Variant("1.0", idem_bin, 1.0)]
    skipped = []
    for v in args.variant:
        if any(v.name == o.name for o in variants):
            sys.exit(f"variant {v.name!r} given twice")
        if not os.path.exists(v.binary):
            print(f"no {v.binary}: skipping variant {v.name!r}", file=sys.stderr)
            skipped.append(v)
            continue
        variants.append(v)
    names = [v.name for v in variants]
    by_name = {v.name: v for v in variants}
    traced = [v.name for v in variants if v.traced]

    workdir = tempfile.mkdtemp(prefix="idemproxy-telemetry-")
    stack = Stack(workdir)
    cpu = {(k, n): [] for k, _ in KINDS for n in names}
    export = {(k, n): [] for k, _ in KINDS for n in names}
    rps = {(k, n): [] for k, _ in KINDS for n in names}
    requests = {(k, n): 0 for k, _ in KINDS for n in names}  # wrk's count, warm-up included
    drops = {(k, n): [] for k, _ in KINDS for n in traced}  # spans dropped in each measured run
    warmup_drops = {}
    threads = {}
    try:
        stack.start_upstream()
        stack.start_receivers(args.python, args.receiver, traced)
        for v in variants:
            stack.start_proxy(v)
            for i in range(1, REPLAY_KEYS + 1):
                status, _, body = post(stack.url(v.name), f"replay-{i}")
                assert status == 201 and len(body) == 1024, (status, len(body))
            status, replayed, body = post(stack.url(v.name), "replay-1")
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
            for kind, _ in KINDS:
                for name in order:
                    script, path = replay, "/v1/payments"
                    if kind == "get":
                        script, path = get, "/v1/payments/pay_1"
                    elif kind == "newkey":
                        script = os.path.join(workdir, f"newkey-{names.index(name)}-{rep}.lua")
                        with open(script, "w") as f:
                            f.write(NEWKEY_LUA % (f"k{time.time_ns()}", REQUEST))
                    dropped0 = metric(stack, name, DROPPED) if name in traced else 0.0
                    per_request, exporting, rate, n = measure(stack, name, args.duration, args.connections,
                                                              script, path)
                    requests[(kind, name)] += n
                    if name in traced:
                        dropped = metric(stack, name, DROPPED) - dropped0
                        if rep >= 0:
                            drops[(kind, name)].append(dropped)
                            if dropped:
                                print(f"FLAGGED: rep {rep + 1} {kind}: {name!r} dropped {dropped:.0f} spans",
                                      file=sys.stderr)
                        elif dropped:
                            warmup_drops[(kind, name)] = dropped
                            print(f"(warm-up {kind}: {name!r} dropped {dropped:.0f} spans; not measured)",
                                  file=sys.stderr)
                    if rep >= 0:
                        cpu[(kind, name)].append(per_request)
                        export[(kind, name)].append(exporting)
                        rps[(kind, name)].append(rate)
            if rep >= 0:
                line = "; ".join(f"{kind} " + " ".join(f"{n} {cpu[(kind, n)][-1]:.1f}" for n in names)
                                 for kind, _ in KINDS)
                print(f"rep {rep + 1}/{args.reps} (order {' '.join(order)}): {line} us/req", file=sys.stderr)
        for name in names:
            threads[name] = thread_names(stack.proxies[name]["proc"].pid)
        outcomes = {n: {o: outcome_count(stack, n, o) for o in ("forwarded", "replayed", "passthrough")}
                    for n in names}
        dropped_total = {n: metric(stack, n, DROPPED) for n in names}
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
    print(f"pinned: every idemproxy alone on CPU {PROXY_CPU} (taskset -c {PROXY_CPU}); nginx, the redis-servers, "
          f"the OTLP receiver, wrk and this script on CPU {LOAD_CPU} (taskset -c {LOAD_CPU})")
    print(f"traced variants export OTLP/gRPC to the {args.receiver} receiver"
          + (" (undecoding, one port per variant)" if args.receiver == "sink" else " (tests/peers/otlp_receiver.py)")
          + "; wrk sends no traceparent (every request a root, sampled at the ratio)")
    print("variants: " + "; ".join(f"{v.name} = {'this build' if v.binary == idem_bin else v.binary}, {v.setting()}"
                                   for v in variants))
    for v in skipped:
        print(f"skipped: {v.name} (no {v.binary})")
    print("ratio: the variant's CPU/request over off's in the same repetition; export threads: "
          f"{' + '.join(EXPORT_THREADS)} (0 without tracing)")

    ratios = {(k, n): [c / o for o, c in zip(cpu[(k, "off")], cpu[(k, n)])] for k, _ in KINDS for n in names}
    for kind, label in KINDS:
        print()
        print(f"{label} (spans per sampled request: {SPANS[kind]})")
        rows = []
        for v in variants:
            n = v.name
            flagged = sum(1 for d in drops.get((kind, n), []) if d)
            rows.append([n, v.setting(), fmt(cpu[(kind, n)]), "1" if n == "off" else fmt_ratio(ratios[(kind, n)]),
                         fmt(export[(kind, n)]), f"{med(rps[(kind, n)]):.0f}",
                         "-" if not v.traced else f"{sum(drops[(kind, n)]):.0f}"
                         + (f" (FLAGGED: {flagged} runs)" if flagged else "")])
        print(table(["variant", "tracing", "CPU us/req", "/ off", "export threads us/req", "req/s",
                     "spans dropped"], rows))

    print()
    print("targets: unsampled / off within noise (compare off-2 / off); 0.1 / off <= 1.08; 1.0 / off <= 1.6")
    print("  (medians; \"within noise\": the unsampled median not above the highest off-2 / off of the repetitions)")
    for kind, label in KINDS:
        noise = ratios[(kind, "off-2")]
        parts = []
        for v in variants:
            if not v.traced:
                continue
            r = med(ratios[(kind, v.name)])
            if v.ratio == 0.0:
                ok = r <= max(noise)
                parts.append(f"{v.name} {r:.3f} {'PASS' if ok else 'FAIL'} (off-2 / off {fmt_ratio(noise)})")
            elif v.ratio in TARGETS:
                ok = r <= TARGETS[v.ratio]
                parts.append(f"{v.name} {r:.3f} {'PASS' if ok else 'FAIL'}")
            else:
                parts.append(f"{v.name} {r:.3f} (no target at {v.ratio:g})")
        print(f"  {label}: " + "; ".join(parts))

    flagged = [(k, n, d) for (k, n), ds in drops.items() for d in ds if d]
    print()
    print("spans dropped (idemproxy_spans_dropped_total, all runs, warm-up included): "
          + ", ".join(f"{n} {dropped_total[n]:.0f}" for n in traced)
          + (f"  -- FLAGGED: {len(flagged)} measured run(s) dropped spans" if flagged else "  (no measured run flagged)"))
    untraced_drops = [n for n in names if n not in traced and dropped_total[n]]
    if untraced_drops:
        print("FLAGGED: untraced variants report dropped spans: " + ", ".join(untraced_drops))
    if sink:
        parts = []
        for n in traced:
            c = sink.get(n, {"exports": 0, "bytes": 0, "spans": 0})
            o = outcomes[n]
            want = SPANS["newkey"] * o["forwarded"] + SPANS["replay"] * o["replayed"] + SPANS["get"] * o["passthrough"]
            got = f"{n} {c['exports']} exports, {c['bytes'] / 1e6:.1f} MB, {c['spans']} spans"
            if by_name[n].ratio and want:
                got += f" = {c['spans'] / want:.4f} of the {want:.0f} the counted requests make"
            parts.append(got)
        print("receiver took: " + "; ".join(parts))
        print("  (counted: forwarded x4, replayed x2, passthrough x2 in idemproxy_requests_total; the requests in "
              "flight when wrk stops are not counted there but traced, a few spans more; under the ratio: spans lost)")
        silent = [n for n in traced if by_name[n].ratio and not sink.get(n, {}).get("exports")]
        if silent:
            print("FLAGGED: no exports arrived from " + ", ".join(silent))
    checks = []
    for n in names:
        o = outcomes[n]
        ok = (o["forwarded"] >= REPLAY_KEYS + requests[("newkey", n)] and o["replayed"] >= 1 + requests[("replay", n)]
              and o["passthrough"] >= requests[("get", n)])
        checks.append(f"{n} " + " ".join(f"{k}={c:.0f}" for k, c in o.items()) + ("" if ok else " MISMATCH"))
    print("checks (requests by outcome; at least what wrk counted): " + "; ".join(checks))
    print("export threads seen: " + "; ".join(
        f"{n} " + (",".join(sorted({t for t in threads[n] if t in EXPORT_THREADS})) or "none") for n in names))


if __name__ == "__main__":
    main()
