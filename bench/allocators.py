#!/usr/bin/env python3
"""The global allocator, measured side by side (docs/performance.md#memory).

Variants (by default; `--variant` replaces them):

  glibc-1-arena   the default build: glibc's malloc held to one arena
                  (`serve::one_arena`), trimmed when connections park;
  glibc-arenas    the same binary with MALLOC_ARENA_MAX = 8 × CPUs, glibc's
                  own default (one_arena steps aside when the variable is set);
  mimalloc        built with `--features alloc-mimalloc`;
  jemalloc        built with `--features alloc-jemalloc`.

Binaries are taken from target/alloc-bins/{glibc,mimalloc,jemalloc}
(`--bins DIR`); build them with

    for v in glibc mimalloc jemalloc; do
      f=""; [ $v != glibc ] && f="--features alloc-$v"
      cargo build --release --bin idemproxy $f && cp target/release/idemproxy target/alloc-bins/$v
    done

Starts, on loopback ports of its own, an nginx-light upstream (a fixed JSON
answer; a 1 MiB file at /v1/mib, also to POST) and a redis-server, both on
CPU 0, and stores 1,000 small records and four 1 MiB records to replay. Then
in every repetition, the variants in an order rotated from one repetition to
the next (interleaved, so that drift of the machine falls on all of them):

  rss         a fresh proxy (default workers, max_connections 2048): RSS idle;
              1,000 keep-alive connections opened one after the other, each
              sends one GET and reads its answer; VmRSS once all are parked
              (`idemproxy_parked_connections`) and 1.5 s more (one period of
              giving freed memory back), then 10 s later ("+10 s"); the
              connections closed. Then THE BURST on the same proxy, VmRSS 1 s
              after it, and the same 1,000 connections again.
  hostile     bench/hostile.py --bin (the variant's environment passed on)
              for the scenarios of `--hostile-only`: peak RSS (max of the
              20 ms VmRSS samples and VmHWM) per scenario, against its target.
  throughput  a fresh proxy pinned to CPU 1 with one worker (wrk, nginx and
              Redis on CPU 0): 2 s warm-up, then wrk for `--duration` s of new
              keys and of replays; requests/s and the proxy's CPU per request
              (utime + stime from /proc/PID/stat over the wrk run). The
              1-minute load average is recorded beside every run.

THE BURST: 10 s (`--burst-seconds`) of wrk, 2 threads, 64 keep-alive
connections, against the Redis store, each connection cycling through 16
requests: 7 protected POSTs with a new key and a small body, 7 replays of the
1,000 small records, one protected POST with a new key and a 768 KiB body
(small answer), one replay of a 1 MiB record.

Ratios are against the first variant (glibc-1-arena) in the same repetition
(the median of the per-repetition ratios, with their range). Prints the
tables and writes bench/results/allocators.json (allocators-<phases>.json
for a run of some phases only; `--json PATH` to choose).

    bench/allocators.py [--reps 3] [--only rss,hostile,throughput] [--duration 5]
                        [--burst-seconds 10] [--large-mib 1] [--settle 10]
                    [--hostile-only abpcdefghi] [--hostile-reps N]
                        [--bins DIR] [--variant NAME=PATH[@VAR=VALUE]...]...

Needs: nginx (nginx-light), wrk, redis-server, taskset, python3.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402  (its helpers: wrk, CPU time, RSS, parked gauge)

ROOT = os.path.dirname(HERE)
MIB = 1 << 20
PROXY_CPU, LOAD_CPU = "1", "0"
UPLOAD = 768 * 1024
LARGE = [MIB]  # the large records' size (--large-mib)
CONNECTIONS = 1000
TARGET_KIB = 20 * 1024  # the product rule: RSS with 1,000 idle connections after a burst

BURST_LUA = bench.STATUS_LUA + r"""
-- 16 requests per cycle: 7 new keys, 7 small replays, one 768 KiB upload
-- with a new key, one 1 MiB replay.
local counter, threads, prefix = 0, 0, "%s-"
local upload = string.rep("u", %d)
function setup(thread) threads = threads + 1; thread:set("id", threads); table.insert(threads_list, thread) end
function init(args) prefix = prefix .. tostring(id) .. "-" end
local json = {["Content-Type"] = "application/json"}
request = function()
  counter = counter + 1
  local slot = counter %% 16
  if slot == 0 then
    return wrk.format("POST", "/v1/mib",
      {["Idempotency-Key"] = "mib-" .. math.random(1, 4), ["Content-Type"] = "application/json"}, '{"amount":4200}')
  elseif slot == 8 then
    return wrk.format("POST", "/v1/payments",
      {["Idempotency-Key"] = prefix .. counter, ["Content-Type"] = "application/octet-stream"}, upload)
  elseif slot %% 2 == 1 then
    return wrk.format("POST", "/v1/payments",
      {["Idempotency-Key"] = prefix .. counter, ["Content-Type"] = "application/json"}, '{"amount":4200}')
  else
    return wrk.format("POST", "/v1/payments",
      {["Idempotency-Key"] = "replay-" .. math.random(1, 1000), ["Content-Type"] = "application/json"},
      '{"amount":4200}')
  end
end
"""


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Rig:
    """The upstream and Redis (CPU 0), and proxies started on demand."""

    def __init__(self, workdir):
        self.dir = workdir
        self.procs = []
        self.up_port, self.redis_port = bench.free_port(), bench.free_port()
        mib = os.path.join(workdir, "large.bin")
        with open(mib, "wb") as f:
            f.write(os.urandom(LARGE[0]))
        os.chmod(workdir, 0o755)
        os.chmod(mib, 0o644)
        conf = os.path.join(workdir, "upstream.conf")
        with open(conf, "w") as f:
            f.write(f"""worker_processes 1;
daemon off;
pid {workdir}/upstream.pid;
error_log {workdir}/upstream.err warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  client_body_temp_path {workdir}/body;
  server {{
    listen 127.0.0.1:{self.up_port} backlog=4096;
    default_type application/json;
    location / {{ return 200 '{bench.BODY}'; }}
    location = /v1/mib {{ default_type application/octet-stream; alias {mib}; error_page 405 =200 $uri; }}
  }}
}}
""")
        self.spawn(["nginx", "-c", conf])
        self.spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", workdir])
        bench.wait_port(self.up_port)
        bench.wait_port(self.redis_port)

    def spawn(self, args, cpu=LOAD_CPU, **kw):
        if cpu is not None:
            args = ["taskset", "-c", cpu] + args
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)
        self.procs.append(p)
        return p

    def proxy(self, variant, tag, pinned=False):
        """A fresh idemproxy of `variant`; pinned: CPU 1, one worker."""
        port, admin = bench.free_port(), bench.free_port()
        cfg = os.path.join(self.dir, f"{tag}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
upstream = "http://127.0.0.1:{self.up_port}"
max_connections = 2048
{"workers = 1" if pinned else ""}

[store]
backend = "redis"
url = "redis://127.0.0.1:{self.redis_port}/0"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "mib"
path = "/v1/mib"
max_response_body = "16MiB"
""")
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        env.update(variant["env"], RUST_LOG="warn")
        log = open(os.path.join(self.dir, f"{tag}.log"), "w")
        p = self.spawn([variant["bin"], "--config", cfg], cpu=PROXY_CPU if pinned else None, env=env, stderr=log)
        bench.wait_port(port)
        bench.wait_http(f"http://127.0.0.1:{admin}/readyz")
        return Proxy(p, port, admin)

    def stop(self):
        bench.stop_all(self.procs)


class Proxy:
    def __init__(self, proc, port, admin):
        self.proc, self.port, self.admin_port = proc, port, admin
        self.pid = proc.pid

    def url(self, path="/x"):
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self):
        bench.stop_all([self.proc])


def post(url, key, timeout=10):
    req = urllib.request.Request(url, data=b'{"amount":4200}', method="POST",
                                 headers={"Idempotency-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return len(r.read())


def store_records(proxy):
    """The records that the burst and the throughput runs replay (once per Redis)."""
    for i in range(1, 1001):
        post(proxy.url("/v1/payments"), f"replay-{i}")
    for i in range(1, 5):
        assert post(proxy.url("/v1/mib"), f"mib-{i}") == LARGE[0], "the large answer came back short"


def with_connections(proxy, settle):
    """1,000 keep-alive connections, each having sent one GET (one after the
    other); VmRSS at once, once all are parked (+1.5 s), and `settle` s later."""
    stack = type("S", (), {"admin_port": proxy.admin_port})()
    socks = []
    req = b"GET /x HTTP/1.1\r\nHost: bench\r\n\r\n"
    try:
        for _ in range(CONNECTIONS):
            s = bench.socket.create_connection(("127.0.0.1", proxy.port))
            s.sendall(req)
            socks.append(s)
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(bench.BODY.encode()):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        at_once = bench.rss_kib(proxy.pid)
        deadline = time.time() + 5
        while time.time() < deadline and bench.parked_connections(stack) < CONNECTIONS:
            time.sleep(0.05)
        parked = bench.parked_connections(stack)
        time.sleep(1.5)  # one period of giving freed memory back, and a margin
        idle = bench.rss_kib(proxy.pid)
        time.sleep(settle)
        return {"at_once": at_once, "idle": idle, "settled": bench.rss_kib(proxy.pid), "parked": parked}
    finally:
        for s in socks:
            s.close()


def run_rss(rig, variant, tag, args):
    """One fresh proxy through a sidecar's life: idle, 1,000 idle connections
    (closed again), the burst, 1,000 idle connections again."""
    out = {}
    p = rig.proxy(variant, f"{tag}-rss")
    try:
        time.sleep(1)
        out["idle"] = bench.rss_kib(p.pid)
        out["noload"] = with_connections(p, args.settle)
        time.sleep(1)
        script = bench.lua(rig.dir, f"{tag}-burst.lua", BURST_LUA % (f"burst{time.time_ns()}", UPLOAD))
        out["burst_wrk"] = bench.wrk(p.url(), args.burst_seconds, connections=64, threads=2, script=script)
        out["burst_peak"] = status_kib(p.pid, "VmHWM")
        time.sleep(1)
        out["after_burst"] = bench.rss_kib(p.pid)
        out["burst"] = with_connections(p, args.settle)
    finally:
        p.stop()
    return out


def run_hostile(variant, tag, args, workdir):
    path = os.path.join(workdir, f"hostile-{tag}.json")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env.update(variant["env"])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "hostile.py"), "--bin", variant["bin"],
                           "--only", args.hostile_only, "--out", path],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(path):
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        sys.exit(f"hostile.py failed for {variant['name']}")
    with open(path) as f:
        data = json.load(f)
    out = {}
    for name, r in data["scenarios"].items():
        out[name] = {"label": r["label"], "peak_kib": max(r["peak_rss_kib"], r["vmhwm_kib"] or 0),
                     "target_kib": r["targets"]["rss_kib"] * 1024, "met": r["targets"]["rss_met"],
                     "crashed": r["crashed"], "twice": len(r["keys_executed_twice"]),
                     "recovery_s": r["recovery"]["full_service_s"]}
    return out


def run_throughput(rig, variant, tag, args):
    p = rig.proxy(variant, f"{tag}-tp", pinned=True)
    try:
        meter = {"proxy": [p.pid]}
        warm = bench.lua(rig.dir, f"{tag}-warm.lua", bench.NEWKEY_LUA % f"warm{time.time_ns()}")
        bench.wrk(p.url(), 2, script=warm)
        out = {"load_before": loadavg()}
        newkey = bench.lua(rig.dir, f"{tag}-newkey.lua", bench.NEWKEY_LUA % f"tp{time.time_ns()}")
        out["newkey"] = bench.wrk(p.url(), args.duration, script=newkey, meter=meter)
        replay = bench.lua(rig.dir, f"{tag}-replay.lua", bench.KEYS_LUA % ("/v1/payments", 1000, "replay"))
        out["replay"] = bench.wrk(p.url(), args.duration, script=replay, meter=meter)
        out["load_after"] = loadavg()
        out["peak_kib"] = status_kib(p.pid, "VmHWM")
        return out
    finally:
        p.stop()


# ---------------------------------------------------------------------------
# Reporting

def mib(kib):
    return kib / 1024


def span(values, f=lambda v: f"{v:.1f}"):
    """median (min–max)"""
    if not values:
        return "—"
    m = statistics.median(values)
    if len(values) == 1 or min(values) == max(values):
        return f(m)
    return f"{f(m)} ({f(min(values))}–{f(max(values))})"


def ratio(runs, base, name, get):
    """Per-repetition ratios of `name` to `base`."""
    return [get(runs[name][i]) / get(runs[base][i]) for i in range(min(len(runs[name]), len(runs[base])))
            if get(runs[base][i])]


def report(res, names, base):
    if res.get("rss"):
        rss = res["rss"]
        print(f"\nRSS, MiB (median (min–max) over {len(rss[base])} repetitions); target after the burst: ≤ 20")
        print(f"{'variant':16} {'idle':>14} {'1,000 idle':>18} {'after burst':>18} {'burst peak':>18} "
              f"{'1,000 after burst':>20} {'+10 s':>18} {'≤ 20':>5}")
        for n in names:
            runs = rss[n]
            col = lambda get: span([mib(get(r)) for r in runs])  # noqa: E731
            met = all(r["burst"]["idle"] <= TARGET_KIB for r in runs)
            print(f"{n:16} {col(lambda r: r['idle']):>14} {col(lambda r: r['noload']['idle']):>18} "
                  f"{col(lambda r: r['after_burst']):>18} {col(lambda r: r['burst_peak']):>18} "
                  f"{col(lambda r: r['burst']['idle']):>20} {col(lambda r: r['burst']['settled']):>18} "
                  f"{'yes' if met else 'NO':>5}")
        print("burst requests/s (all variants share the machine; not a throughput figure): " + ", ".join(
            f"{n} {span([r['burst_wrk']['rps'] for r in rss[n]], lambda v: f'{v:.0f}')}" for n in names))
    if res.get("hostile"):
        hos = res["hostile"]
        scen = list(hos[base][0])
        print(f"\nhostile.py peak RSS, MiB (median over {len(hos[base])} repetitions; target ≤ 96 except (c) ≤ 128)")
        print(f"{'scenario':46}" + "".join(f"{n:>16}" for n in names))
        for s in scen:
            cells = []
            for n in names:
                peaks = [mib(r[s]["peak_kib"]) for r in hos[n]]
                bad = any(not r[s]["met"] or r[s]["crashed"] or r[s]["twice"] for r in hos[n])
                cells.append(f"{statistics.median(peaks):.1f}{' !' if bad else ''}")
            print(f"{hos[base][0][s]['label']:46}" + "".join(f"{c:>16}" for c in cells))
        print(f"{'largest peak':46}" + "".join(
            f"{max(statistics.median(mib(r[s]['peak_kib']) for r in hos[n]) for s in scen):>16.1f}" for n in names))
        print("(! = a repetition missed the target, crashed or ran a key twice)")
    if res.get("throughput"):
        tp = res["throughput"]
        loads = [r[k] for n in names for r in tp[n] for k in ("load_before", "load_after")]
        print(f"\nthroughput, proxy pinned to one CPU, one worker ({len(tp[base])} repetitions, "
              f"1-minute load {min(loads):.2f}–{max(loads):.2f}); ratios to {base} in the same repetition")
        print(f"{'variant':16} {'new keys/s':>20} {'ratio':>18} {'µs CPU/new key':>18} {'ratio':>18} "
              f"{'replays/s':>20} {'ratio':>18} {'µs CPU/replay':>18} {'ratio':>18}")
        f0 = lambda v: f"{v:.0f}"  # noqa: E731
        f2 = lambda v: f"{v:.2f}"  # noqa: E731
        for n in names:
            runs = tp[n]
            cells = []
            for kind in ("newkey", "replay"):
                rps = lambda r, k=kind: r[k]["rps"]  # noqa: E731
                us = lambda r, k=kind: r[k]["proxy_us"]  # noqa: E731
                cells += [span([rps(r) for r in runs], f0), span(ratio(tp, base, n, rps), f2),
                          span([us(r) for r in runs]), span(ratio(tp, base, n, us), f2)]
            print(f"{n:16} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, (20, 18, 18, 18, 20, 18, 18, 18))))


def parse_variants(args):
    if not args.variant:
        bins = args.bins
        arenas = str(8 * (os.cpu_count() or 1))
        return [{"name": "glibc-1-arena", "bin": os.path.join(bins, "glibc"), "env": {}},
                {"name": "glibc-arenas", "bin": os.path.join(bins, "glibc"), "env": {"MALLOC_ARENA_MAX": arenas}},
                {"name": "mimalloc", "bin": os.path.join(bins, "mimalloc"), "env": {}},
                {"name": "jemalloc", "bin": os.path.join(bins, "jemalloc"), "env": {}}]
    out = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        path, *env = rest.split("@")
        out.append({"name": name, "bin": path, "env": dict(kv.split("=", 1) for kv in env)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="rss,hostile,throughput")
    ap.add_argument("--duration", type=int, default=5, help="seconds of each throughput wrk run")
    ap.add_argument("--burst-seconds", type=int, default=10)
    ap.add_argument("--large-mib", type=float, default=1, help="size of the large records the burst replays")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds from the idle reading to the settled one")
    ap.add_argument("--hostile-reps", type=int, help="repetitions of the hostile phase (default: --reps)")
    ap.add_argument("--hostile-only", default="abpcdefghi", help="hostile.py's scenarios (its --only)")
    ap.add_argument("--bins", default=os.path.join(ROOT, "target", "alloc-bins"))
    ap.add_argument("--variant", action="append",
                    help="NAME=PATH[@VAR=VALUE]..., repeatable; replaces the default four; the first is the base")
    ap.add_argument("--json")
    args = ap.parse_args()
    phases = [p for p in args.only.split(",") if p]
    LARGE[0] = int(args.large_mib * MIB)
    variants = parse_variants(args)
    for v in variants:
        if not os.access(v["bin"], os.X_OK):
            sys.exit(f"{v['name']}: no binary at {v['bin']}")
    for tool in ("nginx", "wrk", "redis-server", "taskset"):
        if not bench.shutil.which(tool):
            sys.exit(f"missing {tool}")
    bench.LOAD[:] = ["taskset", "-c", LOAD_CPU]
    names = [v["name"] for v in variants]
    base = names[0]
    workdir = tempfile.mkdtemp(prefix="idemproxy-alloc-")
    rig = Rig(workdir)
    res = {p: {n: [] for n in names} for p in phases}
    started = time.time()
    try:
        p = rig.proxy(variants[0], "store")
        try:
            store_records(p)
        finally:
            p.stop()
        for phase in ("rss", "hostile", "throughput"):
            if phase not in phases:
                continue
            reps = (args.hostile_reps or args.reps) if phase == "hostile" else args.reps
            for rep in range(reps):
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for v in order:
                    tag = f"{v['name']}-{phase}-{rep}"
                    if phase == "rss":
                        r = run_rss(rig, v, tag, args)
                        line = (f"idle {mib(r['idle']):.1f}, 1,000 idle {mib(r['noload']['idle']):.1f}, "
                                f"after burst {mib(r['after_burst']):.1f}, 1,000 after burst "
                                f"{mib(r['burst']['idle']):.1f} (+{args.settle:.0f} s "
                                f"{mib(r['burst']['settled']):.1f}) MiB; burst {r['burst_wrk']['rps']:.0f}/s "
                                f"{r['burst_wrk']['statuses']}")
                    elif phase == "hostile":
                        r = run_hostile(v, tag, args, workdir)
                        line = ", ".join(f"{k} {mib(s['peak_kib']):.1f}" for k, s in r.items()) + " MiB"
                    else:
                        r = run_throughput(rig, v, tag, args)
                        line = (f"new keys {r['newkey']['rps']:.0f}/s {r['newkey']['proxy_us']:.1f} µs, "
                                f"replays {r['replay']['rps']:.0f}/s {r['replay']['proxy_us']:.1f} µs, "
                                f"load {r['load_before']:.2f}→{r['load_after']:.2f}")
                    res[phase][v["name"]].append(r)
                    print(f"{phase} rep {rep + 1}/{reps} {v['name']}: {line}", file=sys.stderr, flush=True)
    finally:
        rig.stop()
        bench.shutil.rmtree(workdir, ignore_errors=True)
    report(res, names, base)
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "nproc": os.cpu_count(), "commit": head.stdout.strip(),
            "variants": variants, "reps": args.reps, "duration_s": args.duration,
            "burst_seconds": args.burst_seconds, "settle_s": args.settle, "hostile_only": args.hostile_only,
            "elapsed_s": round(time.time() - started, 1)}
    name = "allocators.json" if phases == ["rss", "hostile", "throughput"] else f"allocators-{'-'.join(phases)}.json"
    path = args.json or os.path.join(ROOT, "bench", "results", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    print(f"\nwritten {path} ({meta['elapsed_s']} s)")


if __name__ == "__main__":
    main()
