#!/usr/bin/env python3
"""The floor of one client-facing HTTP/1.1 exchange, next to nginx.

Pinned as bench.py --pin (the measured server on CPU 1, one worker; wrk,
the upstream and Redis on CPU 0). In every repetition, alternating order,
wrk -t2 -c64 against:
  - nginx as the proxy (pass-through), the reference of the performance targets;
  - nginx answering by itself (a `return 200` server on CPU 1): nginx's own
    cost of a client exchange with no upstream;
  - examples/hyper_floor: a hyper server answering from memory, one tokio
    worker: the same for idemproxy's stack;
  - examples/hyper_floor with each answer read by reserve.lua from Redis:
    through redis-rs's ConnectionManager (as idemproxy used it until
    2026-12-01, and still does over TLS), through a minimal pipelined client,
    and through idemproxy's own connection (store::wire, a Cmd in and a Value
    out): a replay's exchange and store round trip without the rest of the
    protected path;
  - examples/hyper_floor replaying as the contract asks and no more (replay:PORT:
    the body read, the key parsed, fingerprint and record id hashed, the
    reserve through store::wire, the record decoded and answered): the
    replay's floor with the replay's own request, POST and body;
  - examples/hyper_floor forwarding each request as it came to the upstream
    through idemproxy's own upstream pool, the answer streamed back: hyper's
    cost of a proxied exchange without idemproxy's per-request work;
  - examples/hyper_floor forwarding as the contract asks and no more
    (passthrough:PORT: idemproxy's `Upstream::prepare` and
    `send_with_timeout`: forwarding headers, hop-by-hop stripping,
    `upstream_timeout`): the pass-through's floor;
  - idemproxy passing GETs through (the same exchanges, with its own work);
  - idemproxy replaying stored keys (a client exchange plus one Redis round trip).
The hyper_floor servers run on a current-thread runtime, as each of
idemproxy's worker threads does. Prints CPU µs per request (utime + stime
from /proc) and the ratios to the nginx proxy, paired per repetition.

    bench/floor.py [--reps 5] [--duration 3]
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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=3)
    args = ap.parse_args()
    # Two builds: one with the example would build idemproxy with the dev-dependencies'
    # features too (tokio's test-util, whose clock takes a lock), not the binary that ships.
    # The example itself has them (+0.5 % instructions on the replay floor, callgrind).
    subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=bench.ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--example", "hyper_floor"], cwd=bench.ROOT, check=True)
    bench.LOAD[:] = ["taskset", "-c", bench.LOAD_CPU]
    workdir = tempfile.mkdtemp(prefix="idemproxy-floor-")
    stack = bench.Stack(workdir, pin=True)
    # The floors on a current-thread runtime, as each of idemproxy's worker
    # threads runs (a multi-thread runtime with one worker until 2026-12-01,
    # 3 % more instructions: docs/dev/benchmarks-journal.md's earlier figures).
    FLOOR_ENV = dict(os.environ, FLOOR_RUNTIME="current")
    try:
        stack.start(os.path.join(bench.ROOT, "target", "release", "idemproxy"))
        floor_bin = os.path.join(bench.ROOT, "target", "release", "examples", "hyper_floor")
        floor_port, solo_port = bench.free_port(), bench.free_port()
        redis_port, raw_port, wire_port = bench.free_port(), bench.free_port(), bench.free_port()
        proxy_port, replaying_port, forward_port = bench.free_port(), bench.free_port(), bench.free_port()
        floor = stack.spawn([floor_bin, f"127.0.0.1:{floor_port}"], proxy=True, env=FLOOR_ENV)
        via_redis = stack.spawn([floor_bin, f"127.0.0.1:{redis_port}", f"redis:{stack.redis_port}"], proxy=True, env=FLOOR_ENV)
        via_raw = stack.spawn([floor_bin, f"127.0.0.1:{raw_port}", f"raw:{stack.redis_port}"], proxy=True, env=FLOOR_ENV)
        via_wire = stack.spawn([floor_bin, f"127.0.0.1:{wire_port}", f"wire:{stack.redis_port}"], proxy=True, env=FLOOR_ENV)
        proxying = stack.spawn([floor_bin, f"127.0.0.1:{proxy_port}", f"proxy:{stack.up_port}"], proxy=True, env=FLOOR_ENV)
        replaying = stack.spawn([floor_bin, f"127.0.0.1:{replaying_port}", f"replay:{stack.redis_port}"], proxy=True, env=FLOOR_ENV)
        forwarding = stack.spawn([floor_bin, f"127.0.0.1:{forward_port}", f"passthrough:{stack.up_port}"], proxy=True, env=FLOOR_ENV)
        solo_conf = stack.nginx_conf("solo", 1, f"listen 127.0.0.1:{solo_port} backlog=4096; "
                                     f"default_type application/json; location / {{ return 200 '{bench.BODY}'; }}")
        solo = stack.spawn(["nginx", "-c", solo_conf], proxy=True)
        for port in (floor_port, redis_port, raw_port, wire_port, proxy_port, replaying_port, forward_port):
            bench.wait_port(port)
        bench.wait_port(solo_port)
        for i in range(1, 1001):
            bench.post(stack.url("idemproxy", "/v1/payments"), f"replay-{i}")
        replay = bench.lua(workdir, "replay.lua", bench.KEYS_LUA % ("/v1/payments", 1000, "replay"))
        targets = {
            "nginx proxy, pass-through": (stack.url("nginx"), None, bench.with_children(stack.nginx.pid)),
            "nginx answering itself": (f"http://127.0.0.1:{solo_port}/x", None, bench.with_children(solo.pid)),
            "hyper answering from memory": (f"http://127.0.0.1:{floor_port}/x", None, [floor.pid]),
            "hyper + reserve.lua, redis-rs": (f"http://127.0.0.1:{redis_port}/x", None, [via_redis.pid]),
            "hyper + reserve.lua, minimal": (f"http://127.0.0.1:{raw_port}/x", None, [via_raw.pid]),
            "hyper + reserve.lua, store::wire": (f"http://127.0.0.1:{wire_port}/x", None, [via_wire.pid]),
            "hyper proxying (idemproxy's pool)": (f"http://127.0.0.1:{proxy_port}/x", None, [proxying.pid]),
            "hyper forwarding, the contract's minimum": (f"http://127.0.0.1:{forward_port}/x", None,
                                                         [forwarding.pid]),
            "hyper replaying, the contract's minimum": (f"http://127.0.0.1:{replaying_port}/v1/payments", replay,
                                                        [replaying.pid]),
            "idemproxy, pass-through": (stack.url("idemproxy"), None, [stack.idem.pid]),
            "idemproxy, replay": (stack.url("idemproxy", "/v1/payments"), replay, [stack.idem.pid]),
        }
        for url, script, _ in targets.values():
            bench.wrk(url, 1, script=script)
        runs = {k: [] for k in targets}
        for rep in range(args.reps):
            order = list(targets) if rep % 2 == 0 else list(reversed(targets))
            for name in order:
                url, script, pids = targets[name]
                runs[name].append(bench.wrk(url, args.duration, script=script, meter={"proxy": pids}))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]['proxy_us']:.1f} µs" for k, v in runs.items()),
                  file=sys.stderr)
    finally:
        stack.stop()
    ref = runs["nginx proxy, pass-through"]
    print(f"\n{'server (CPU 1, one worker)':40} {'req/s':>10} {'CPU µs/request':>16} {'vs nginx proxy (paired)':>24}")
    for name, rs in runs.items():
        ratio = statistics.median(r["proxy_us"] / n["proxy_us"] for r, n in zip(rs, ref))
        print(f"{name:40} {statistics.median(r['rps'] for r in rs) / 1000:9.1f}k "
              f"{statistics.median(r['proxy_us'] for r in rs):16.2f} {ratio:23.2f}x")


if __name__ == "__main__":
    main()
