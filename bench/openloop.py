#!/usr/bin/env python3
"""Open-loop latency at a fixed rate: what each proxy adds over the upstream,
with the pass-through's floors beside idemproxy and nginx.

bench.py measures the open loop once per target with three repetitions; the
p50 it adds is a difference of two numbers that each swing by more than it
on these machines. This runs more repetitions of only that, pinned as
bench.py --pin (the proxies, one worker each, on CPU 1; oha, the upstream
and Redis on CPU 0), the order rotated each time, against:
  - the upstream directly (the reference every "added" figure subtracts,
    from the same repetition);
  - nginx proxying (one worker);
  - idemproxy passing GETs through (workers = 1);
  - examples/hyper_floor forwarding as the contract asks and no more
    (passthrough:PORT, the pass-through's floor on idemproxy's stack);
  - examples/hyper_floor forwarding as it came through idemproxy's pool
    (proxy:PORT, hyper's bare cost of a proxied exchange).
Prints, for each, the median p50 and p99 and the median over repetitions of
what it adds over the upstream in the same repetition, and the proxy's CPU
time per request and share of its CPU busy during the run (from /proc): in
an open loop the latency a proxy adds grows with how busy it is, much
faster than in proportion once its CPU is more than about half busy.

    bench/openloop.py [--reps 10] [--rate N | --share F] [--seconds 8]

--rate defaults to --share (0.4) of nginx's closed-loop maximum (wrk -t2
-c64, measured first): 40 % is the performance issue's open-loop target.
Needs: nginx (nginx-light), wrk, oha, redis-server, cargo, taskset.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rate", type=int, help="requests per second (default: --share of nginx's maximum)")
    ap.add_argument("--share", type=float, default=0.4, help="the rate as a share of nginx's maximum")
    ap.add_argument("--seconds", type=int, default=8, help="length of each oha run")
    args = ap.parse_args()
    if args.share <= 0 or (args.rate is not None and args.rate <= 0):
        ap.error("--rate and --share must be above 0 (oha takes a rate of 0 as no limit)")
    subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=bench.ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--example", "hyper_floor"], cwd=bench.ROOT, check=True)
    bench.LOAD[:] = ["taskset", "-c", bench.LOAD_CPU]
    stack = bench.Stack(tempfile.mkdtemp(prefix="idemproxy-openloop-"), pin=True)
    try:
        stack.start(os.path.join(bench.ROOT, "target", "release", "idemproxy"))
        stack.start_floors(os.path.join(bench.ROOT, "target", "release", "examples", "hyper_floor"))
        urls = {
            "upstream directly": stack.url("direct"),
            "nginx proxy": stack.url("nginx"),
            "idemproxy, pass-through": stack.url("idemproxy"),
            "floor: the contract's minimum forward": f"http://127.0.0.1:{stack.floors['floor_pt'][0]}/x",
            "floor: hyper through idemproxy's pool": f"http://127.0.0.1:{stack.floors['floor_bare'][0]}/x",
        }
        pids = {
            "nginx proxy": bench.with_children(stack.nginx.pid),
            "idemproxy, pass-through": [stack.idem.pid],
            "floor: the contract's minimum forward": [stack.floors["floor_pt"][1]],
            "floor: hyper through idemproxy's pool": [stack.floors["floor_bare"][1]],
        }
        for url in urls.values():
            bench.wrk(url, 1)
        rate = args.rate or int(args.share * bench.wrk(stack.url("nginx"), 3)["rps"])
        runs = {k: [] for k in urls}
        for rep in range(args.reps):
            names = list(urls)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for name in names:
                before = bench.cpu_seconds(pids.get(name, []))
                r = bench.oha(urls[name], rate, args.seconds)
                # CPU time over the whole run (oha's start and end included: a slight overcount).
                cpu = bench.cpu_seconds(pids.get(name, [])) - before
                r["cpu_us"] = cpu / max(r["rps"] * args.seconds, 1) * 1e6
                r["busy"] = cpu / args.seconds
                runs[name].append(r)
            print(f"rep {rep + 1}/{args.reps}: p50 µs " + ", ".join(
                f"{k.split(',')[0].split(':')[-1].strip()} {v[-1]['p50_ms'] * 1000:.0f}" for k, v in runs.items()),
                file=sys.stderr)
    finally:
        stack.stop()
    direct = runs["upstream directly"]
    print(f"\nopen loop at {rate} req/s (oha -c64, latency-corrected), {args.reps} repetitions of "
          f"{args.seconds} s, pinned; medians:")
    print(f"{'server (CPU 1, one worker)':40} {'p50 µs':>8} {'added':>8} {'p99 µs':>8} {'added':>8} "
          f"{'CPU µs/req':>10} {'busy':>5}  p50 added > nginx's")
    ngx = runs["nginx proxy"]
    for name, rs in runs.items():
        add = {p: statistics.median(r[f"{p}_ms"] - d[f"{p}_ms"] for r, d in zip(rs, direct)) * 1000
               for p in ("p50", "p99")}
        over = sum(r["p50_ms"] > n["p50_ms"] for r, n in zip(rs, ngx))
        cpu = "" if name not in pids else (f"{statistics.median(r['cpu_us'] for r in rs):10.1f} "
                                           f"{statistics.median(r['busy'] for r in rs):5.0%}")
        print(f"{name:40} {statistics.median(r['p50_ms'] for r in rs) * 1000:8.0f} {add['p50']:+8.0f} "
              f"{statistics.median(r['p99_ms'] for r in rs) * 1000:8.0f} {add['p99']:+8.0f} "
              f"{cpu:>16}  in {over} of {len(rs)}")


if __name__ == "__main__":
    main()
