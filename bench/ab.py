#!/usr/bin/env python3
"""Two idemproxy builds side by side: CPU per request, paired.

Pinned as bench.py --pin: both proxies on CPU 1 with one worker each (only
one is loaded at a time), wrk, the upstream (nginx) and Redis on CPU 0. In
every repetition, for each scenario (pass-through GET, protected POST with a
new key, replay of a stored key), wrk -t2 -c64 runs against A then B, or B
then A on odd repetitions. Prints each build's median CPU µs per request
(utime + stime from /proc) and the median of the paired ratios B/A, which is
what to read: single figures move with the machine, the ratios much less.
Both builds share one Redis (only one is loaded at a time), so its CPU per
request is each build's too: printed beside the proxy's.

    bench/ab.py --a OLD_BINARY --b NEW_BINARY [--reps 7] [--duration 3]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

SCENARIOS = ("pass-through", "new key", "replay")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the build to compare against")
    ap.add_argument("--b", required=True, help="the build under test")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--duration", type=int, default=3)
    args = ap.parse_args()
    bench.LOAD[:] = ["taskset", "-c", bench.LOAD_CPU]
    workdir = tempfile.mkdtemp(prefix="idemproxy-ab-")
    stack = bench.Stack(workdir, pin=True)
    try:
        stack.start(os.path.abspath(args.a))
        port, admin = bench.free_port(), bench.free_port()
        cfg = stack.idem_conf("idemproxy-b", port, admin, f"http://127.0.0.1:{stack.up_port}")
        b = stack.spawn([os.path.abspath(args.b), "--config", cfg], proxy=True,
                        env=dict(os.environ, RUST_LOG="warn"), stderr=stack.log("idemproxy-b"))
        bench.wait_port(port)
        builds = {
            "A": (lambda path="/": stack.url("idemproxy", path), [stack.idem.pid]),
            "B": (lambda path="/": f"http://127.0.0.1:{port}{path}", [b.pid]),
        }
        replay = {}
        for name, (url, _) in builds.items():
            for i in range(1, 1001):
                bench.post(url("/v1/payments"), f"replay-{name}-{i}")
            replay[name] = bench.lua(workdir, f"replay-{name}.lua",
                                     bench.KEYS_LUA % ("/v1/payments", 1000, f"replay-{name}"))
            bench.wrk(url(), 2)
        runs = {(s, n): [] for s in SCENARIOS for n in builds}
        for rep in range(args.reps):
            order = ("A", "B") if rep % 2 == 0 else ("B", "A")
            for scenario in SCENARIOS:
                for name in order:
                    url, pids = builds[name]
                    if scenario == "pass-through":
                        script = None
                    elif scenario == "new key":
                        script = bench.lua(workdir, f"newkey-{name}-{rep}.lua",
                                           bench.NEWKEY_LUA % f"ab{name}{time.time_ns()}")
                    else:
                        script = replay[name]
                    r = bench.wrk(url(), args.duration, script=script, meter={"proxy": pids, "redis": [stack.redis.pid]})
                    if r["non2xx"]:
                        print(f"warning: {name} {scenario}: non-2xx answers {r['statuses']}", file=sys.stderr)
                    runs[(scenario, name)].append(r)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{s} {runs[(s, 'A')][-1]['proxy_us']:.1f}/{runs[(s, 'B')][-1]['proxy_us']:.1f} µs"
                for s in SCENARIOS), file=sys.stderr)
    finally:
        stack.stop()
    print(f"\nA = {args.a}\nB = {args.b}\n")
    print(f"{'scenario':14} {'A µs/req':>9} {'B µs/req':>9} {'B/A CPU':>8} {'B/A req/s':>10}"
          f" {'Redis A µs':>11} {'Redis B µs':>11} {'B/A':>6}  (medians of {args.reps}, paired)")
    for s in SCENARIOS:
        a, b = runs[(s, "A")], runs[(s, "B")]
        cpu = statistics.median(y["proxy_us"] / x["proxy_us"] for x, y in zip(a, b))
        rps = statistics.median(y["rps"] / x["rps"] for x, y in zip(a, b))
        print(f"{s:14} {statistics.median(r['proxy_us'] for r in a):9.2f} "
              f"{statistics.median(r['proxy_us'] for r in b):9.2f} {cpu:8.3f} {rps:10.3f}"
              f" {statistics.median(r['redis_us'] for r in a):11.2f} {statistics.median(r['redis_us'] for r in b):11.2f}"
              f" {statistics.median(y['redis_us'] / max(x['redis_us'], 1e-9) for x, y in zip(a, b)):6.3f}")


if __name__ == "__main__":
    main()
