#!/usr/bin/env python3
"""Multi-core: idemproxy's worker models side by side, unpinned, next to nginx.

The performance issue asks that more workers (the unpinned layout) cost no
more per request than one worker per core. Everything runs unpinned on the
machine's CPUs, as bench.py without --pin: the upstream (nginx), Redis and
wrk beside the proxies. Four configurations of one binary, each its own
process, and nginx with one worker process per CPU:

  - per_thread     runtime = "per_thread" (the default), workers = CPUs
  - work_stealing  runtime = "work_stealing", workers = CPUs
  - one worker     workers = 1 (per_thread)
  - nginx          worker_processes = CPUs, the reference

In every repetition, alternating order, wrk -t2 -c64 runs pass-through GETs,
protected POSTs with new keys and replays of stored keys against each.
Prints requests per second, CPU µs per request (utime + stime from /proc),
the ratio to nginx's pass-through CPU (paired per repetition), and per
request the context switches and futex calls of the proxy (perf stat, when
tracepoints are readable; a futex call is a thread waking another).

    bench/workers.py [--bin BINARY] [--reps 5] [--duration 3]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

CONFIGS = {
    "per_thread": 'runtime = "per_thread"',
    "work_stealing": 'runtime = "work_stealing"',
    "one worker": "workers = 1",
}
SCENARIOS = ("pass-through", "new key", "replay")


def perf_usable():
    """Whether `perf stat` can read the syscall tracepoints here."""
    try:
        out = subprocess.run(["perf", "stat", "-x,", "-e", "syscalls:sys_enter_futex", "true"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "not supported" not in out.stderr and "<not" not in out.stderr


def metered(url, pids, duration, script, perf):
    """One wrk run with CPU per request, and switches and futex calls per request under perf."""
    watcher = None
    if perf:
        watcher = subprocess.Popen(["perf", "stat", "-x,", "-e", "context-switches,syscalls:sys_enter_futex",
                                    "-p", ",".join(map(str, pids))], stderr=subprocess.PIPE, text=True)
        time.sleep(0.2)
    r = bench.wrk(url, duration, script=script, meter={"proxy": pids})
    if watcher:
        watcher.send_signal(2)
        for line in watcher.communicate()[1].splitlines():
            f = line.split(",")
            if len(f) > 2 and f[0].strip().isdigit():
                r[f[2].split(":")[-1]] = int(f[0]) / max(r["requests"], 1)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", help="an idemproxy binary (default: build this checkout)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=3)
    args = ap.parse_args()
    binary = args.bin
    if not binary:
        subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=bench.ROOT, check=True)
        binary = os.path.join(bench.ROOT, "target", "release", "idemproxy")
    binary = os.path.abspath(binary)
    perf = perf_usable()
    workdir = tempfile.mkdtemp(prefix="idemproxy-workers-")
    stack = bench.Stack(workdir, pin=False)
    try:
        stack.start(binary)
        proxies = {}
        for name, line in CONFIGS.items():
            port, admin = bench.free_port(), bench.free_port()
            cfg = stack.idem_conf(name.replace(" ", "-"), port, admin, f"http://127.0.0.1:{stack.up_port}")
            with open(cfg) as f:
                text = f.read().replace("[server]\n", f"[server]\n{line}\n", 1)
            with open(cfg, "w") as f:
                f.write(text)
            proc = stack.spawn([binary, "--config", cfg], env=dict(os.environ, RUST_LOG="warn"),
                               stderr=stack.log(name.replace(" ", "-")))
            bench.wait_port(port)
            bench.wait_http(f"http://127.0.0.1:{admin}/readyz")
            proxies[name] = (port, [proc.pid])
        # One store for all: keys stored through one replay through every other.
        for i in range(1, 1001):
            bench.post(stack.url("idemproxy", "/v1/payments"), f"replay-{i}")
        replay = bench.lua(workdir, "replay.lua", bench.KEYS_LUA % ("/v1/payments", 1000, "replay"))
        targets = {("nginx", "pass-through"): (stack.url("nginx"), bench.with_children(stack.nginx.pid), None)}
        for name, (port, pids) in proxies.items():
            for s in SCENARIOS:
                path = "/v1/payments" if s == "replay" else "/x"
                targets[(name, s)] = (f"http://127.0.0.1:{port}{path}", pids, s)
        for url, _, s in targets.values():
            if s != "new key":
                bench.wrk(url, 1, script=replay if s == "replay" else None)
        runs = {k: [] for k in targets}
        for rep in range(args.reps):
            order = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for key in order:
                url, pids, s = targets[key]
                script = None
                if s == "replay":
                    script = replay
                elif s == "new key":
                    script = bench.lua(workdir, f"newkey-{rep}-{len(runs[key])}-{key[0][0]}.lua",
                                       bench.NEWKEY_LUA % f"w{key[0][0]}{time.time_ns()}")
                runs[key].append(metered(url, pids, args.duration, script, perf))
            print(f"rep {rep + 1}/{args.reps}", file=sys.stderr)
    finally:
        stack.stop()
    ref = runs[("nginx", "pass-through")]
    cpus = os.cpu_count()
    print(f"\nunpinned, {cpus} CPUs; nginx with {cpus} workers; medians of {args.reps}"
          + ("" if perf else " (perf tracepoints unreadable: no switch or futex counts)"))
    print(f"{'proxy':14} {'scenario':13} {'req/s':>9} {'CPU µs/req':>11} {'vs nginx':>9}"
          f" {'switches/req':>13} {'futex/req':>10}")
    for (name, s), rs in runs.items():
        ratio = statistics.median(r["proxy_us"] / n["proxy_us"] for r, n in zip(rs, ref))
        med = lambda k: statistics.median(r.get(k, 0.0) for r in rs)  # noqa: E731
        print(f"{name:14} {s:13} {med('rps') / 1000:8.1f}k {med('proxy_us'):11.2f} {ratio:8.2f}x"
              f" {med('context-switches'):13.3f} {med('sys_enter_futex'):10.3f}")


if __name__ == "__main__":
    main()
