#!/usr/bin/env python3
"""PostgreSQL beside Redis: what a new key and a replay cost on each store.

Starts, on loopback ports of its own: an nginx-light upstream answering a fixed
1 KiB JSON body, a redis-server (no persistence, as in bench.py) and a
PostgreSQL server (a fresh initdb in a temporary directory, `fsync = off` so
that the disk does not decide, `synchronous_commit` on, no standby,
pg_stat_statements loaded), and two idemproxy processes (this build, release),
one on each store; the PostgreSQL table is made with `idemproxy --init-store`.

Then, in every repetition, for each workload, drives the two proxies one after
the other (which goes first alternates) with wrk:

  - "new key": protected POSTs with a new key per request (reserve, forward, complete);
  - "replay": replays of 1,000 stored keys (one reserve each);

and reads, around each run:

  - the proxy's CPU time (utime + stime of all its threads, /proc/<pid>/stat);
  - the store's CPU time: redis-server's; for PostgreSQL the postmaster and
    every process of it (the proxy's backends, the WAL writer, the
    checkpointer...), summed over /proc, with those it reaped meanwhile;
  - the store's round trips: for PostgreSQL the statements on the table
    (pg_stat_statements `calls`; every operation is one statement); for Redis
    `GETRANGE` calls in `INFO commandstats` (a reserve is SET NX + GETRANGE in
    one write, a completion a script that runs one GETRANGE: exactly one per
    round trip);
  - p50 and p99 latency (wrk --latency);
  - the proxy's context switches per request, over its threads (voluntary
    and not, /proc/<pid>/task/*/status): a store that answers later leaves
    the proxy's worker asleep in epoll_wait more often per request, and each
    sleep and wake-up is kernel time the proxy is charged.

With --pin each proxy runs with one worker on CPU 1 and everything else
(wrk, nginx, redis-server, PostgreSQL) on CPU 0: the proxy's CPU is then
not shared with the store's processes, as when the database runs on a
machine of its own. With --pace MS each wrk connection waits MS ms after an
answer before its next request, so that both stores run at about the same rate, well below
either's maximum: without it each proxy runs flat out and PostgreSQL's runs
at about a third of Redis's rate, and a proxy that waits on its store more
wakes up more often per request.

Prints, per workload, the medians (min-max) per store and the paired ratios
postgres/redis of each repetition; writes everything as JSON with --out.

    bench/stores.py [--reps 3] [--duration 3] [--connections 8] [--pace MS] [--pin] [--out bench/results/stores.json]

Needs: nginx (nginx-light), wrk, redis-server, PostgreSQL's server binaries
(/usr/lib/postgresql/*/bin; run as root, they run as the postgres user), cargo.
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import free_port, wait_http, wait_port  # noqa: E402
from sealing import NEWKEY_LUA, REPLAY_KEYS, REPLAY_LUA, REQUEST, Stack, cpu_seconds, post  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORES = ("redis", "postgres")


def pg_bin():
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        sys.exit("PostgreSQL's server binaries are not installed (apt-get install postgresql)")
    return os.path.dirname(found[-1])


def as_postgres(args):
    """A PostgreSQL tool's command line, as the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"] + args
    return args


def psql(port, sql):
    out = subprocess.run([os.path.join(pg_bin(), "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                          "-d", "postgres", "-Atqc", sql], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def tree_cpu(root_pid):
    """CPU seconds of a process and all its descendants: those alive now (from
    /proc), and those it has reaped (its cutime + cstime), so that a backend
    or an autovacuum worker that exits in between takes none away."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    with open(f"/proc/{root_pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    total, todo = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK"), [root_pid]
    while todo:
        pid = todo.pop()
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass
        todo.extend(children.get(pid, []))
    return total


class Stores(Stack):
    def __init__(self, workdir, pin=False):
        super().__init__(workdir)
        self.pin = pin

    def spawn(self, args, **kw):
        """Starts a process; with --pin, a proxy on CPU 1 and anything else on CPU 0."""
        if self.pin:
            cpu = "1" if os.path.basename(args[0]).startswith("idemproxy") else "0"
            args = ["taskset", "-c", cpu] + args
        return super().spawn(args, **kw)

    def start_postgres(self):
        data = os.path.join(self.dir, "pgdata")
        os.makedirs(data)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            shutil.chown(data, "postgres", "postgres")
        subprocess.run(as_postgres([os.path.join(pg_bin(), "initdb"), "-D", data, "-U", "postgres", "-A", "trust",
                                    "-E", "UTF8", "--no-sync"]), check=True, stdout=subprocess.DEVNULL)
        self.pg_port = free_port()
        self.pg = self.spawn(as_postgres([
            os.path.join(pg_bin(), "postgres"), "-D", data, "-p", str(self.pg_port),
            "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=", "-c", "fsync=off",
            "-c", "shared_preload_libraries=pg_stat_statements", "-c", "pg_stat_statements.track=all"]))
        wait_port(self.pg_port)
        for _ in range(100):
            try:
                psql(self.pg_port, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                return
            except subprocess.CalledProcessError:
                time.sleep(0.1)
        sys.exit("postgres did not start")

    def start_store_proxy(self, name, idem_bin):
        port, admin = free_port(), free_port()
        if name == "redis":
            self.redis_port = free_port()
            self.redis = self.spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", self.dir])
            wait_port(self.redis_port)
            store = f'backend = "redis"\nurl = "redis://127.0.0.1:{self.redis_port}/0"'
        else:
            store = f'backend = "postgres"\nurl = "postgres://postgres@127.0.0.1:{self.pg_port}/postgres"'
        cfg = os.path.join(self.dir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
upstream = "http://127.0.0.1:{self.up_port}"
{"workers = 1" if self.pin else ""}

[store]
{store}

[[routes]]
name = "payments"
path = "/v1/payments"
""")
        if name == "postgres":
            subprocess.run([idem_bin, "--config", cfg, "--init-store"], check=True, stdout=subprocess.DEVNULL)
        proc = self.spawn([idem_bin, "--config", cfg], env=dict(os.environ, RUST_LOG="warn"))
        wait_port(port)
        wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.proxies[name] = {"proc": proc, "port": port, "admin": admin}

    def store_cpu(self, name):
        return cpu_seconds(self.redis.pid) if name == "redis" else tree_cpu(self.pg.pid)

    def round_trips(self, name):
        if name == "redis":
            out = subprocess.run(["redis-cli", "-p", str(self.redis_port), "INFO", "commandstats"],
                                 capture_output=True, text=True, check=True).stdout
            m = re.search(r"cmdstat_getrange:calls=(\d+)", out)
            return int(m.group(1)) if m else 0
        # The proxy's statements on its table; not the readiness ping (LIMIT 0) or the sweep.
        return int(psql(self.pg_port, "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                                      "WHERE query LIKE '%idemproxy_records%' AND query NOT LIKE '%LIMIT 0%' "
                                      "AND query NOT LIKE '%SKIP LOCKED%' AND query NOT LIKE '%pg_stat%'"))


def thread_counters(pid):
    """(CPU seconds, context switches) of a process's live threads, as the
    scheduler counts them (/proc/<pid>/task/*/schedstat, in nanoseconds, and
    the voluntary and involuntary switches in .../status). The CPU time is
    exact, where utime + stime are counted in ticks, which a process that
    runs in bursts of a few microseconds between sleeps can be charged too
    much or too little of."""
    run, switches = 0, 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                run += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        switches += int(line.split()[-1])
        except OSError:
            pass
    return run / 1e9, switches


def wrk(url, duration, connections, script, pin=False):
    pinned = ["taskset", "-c", "0"] if pin else []
    out = subprocess.run(pinned + ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", script, url],
                         capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        print(f"warning: {non2xx.group(1)} answers were not 2xx", file=sys.stderr)

    def ms(label):
        m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        value, unit = float(m.group(1)), m.group(2)
        return value * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    return int(re.search(r"(\d+) requests in", out).group(1)), ms("50%"), ms("99%")


# --profile: where a proxy's CPU goes, from the call stacks perf sampled, in
# the order the rules are tried; the leaf frame decides kernel or user.
PROFILE_RULES = (
    ("waking another process", True, re.compile(r"sock_def_readable|try_to_wake_up|ep_poll_callback")),
    ("sleeping and being woken", True, re.compile(r"schedule|finish_task_switch|__switch_to|exit_to_user_mode_loop")),
    ("other kernel: TCP, epoll", True, None),
    ("the PostgreSQL client", False, re.compile(r"tokio_postgres|postgres_protocol|postgres_types|deadpool|store::postgres")),
    ("the Redis client", False, re.compile(r"store::wire|store::ops|store::redis|store::conn|store::reply|redis::")),
    ("the rest: HTTP, tokio, records, malloc", False, None),
)


def profile_shares(data):
    """Each PROFILE_RULES category's share of the samples in a perf.data."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"], capture_output=True, text=True).stdout
    counts, total = {c: 0 for c, _, _ in PROFILE_RULES}, 0
    for sample in out.split("\n\n"):
        frames = [line.split(None, 1) for line in sample.strip().splitlines()]
        frames = [(int(f[0], 16), f[1] if len(f) > 1 else "") for f in frames if f and f[0].strip()]
        if not frames:
            continue
        total += 1
        kernel = frames[0][0] >= 0xffff800000000000
        stack = " ".join(sym for _, sym in frames)
        for category, in_kernel, pattern in PROFILE_RULES:
            if in_kernel == kernel and (pattern is None or pattern.search(stack)):
                counts[category] += 1
                break
    return {c: k / total for c, k in counts.items()} if total else {}


def run_one(stack, name, duration, connections, script, profile=False):
    proxy_pid = stack.proxies[name]["proc"].pid
    (p0, c0), s0, r0 = thread_counters(proxy_pid), stack.store_cpu(name), stack.round_trips(name)
    perf = None
    if profile:
        data = os.path.join(stack.dir, f"perf-{name}.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "2999", "-g", "-p", str(proxy_pid), "-o", data],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n, p50, p99 = wrk(stack.url(name), duration, connections, script, stack.pin)
    if perf:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    # pg_stat_statements and the backends' CPU are current once the statements are done.
    time.sleep(0.2)
    (p1, c1), s1, r1 = thread_counters(proxy_pid), stack.store_cpu(name), stack.round_trips(name)
    return {
        "requests": n,
        "rps": n / duration,
        "proxy_cpu_us": (p1 - p0) * 1e6 / n,
        "proxy_switches": (c1 - c0) / n,
        "store_cpu_us": (s1 - s0) * 1e6 / n,
        "round_trips": (r1 - r0) / n,
        "p50_ms": p50,
        "p99_ms": p99,
        **({f"us: {c}": share * (p1 - p0) * 1e6 / n
            for c, share in profile_shares(os.path.join(stack.dir, f"perf-{name}.data")).items()}
           if profile else {}),
    }


def fmt(values, digits=1):
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--pace", type=int, default=0, metavar="MS",
                    help="each connection waits MS ms after an answer before its next request "
                         "(both stores then run at about the same rate, below either's maximum)")
    ap.add_argument("--profile", action="store_true",
                    help="sample each proxy with perf and split its CPU per request by where it goes")
    ap.add_argument("--pin", action="store_true",
                    help="each proxy with one worker on CPU 1; wrk, nginx and the stores on CPU 0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "idemproxy"))
    args = ap.parse_args()
    if not os.path.exists(args.binary):
        subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)

    work = tempfile.mkdtemp(prefix="idem-stores-")
    stack = Stores(work, pin=args.pin)
    try:
        stack.start_upstream()
        stack.start_postgres()
        for name in STORES:
            stack.start_store_proxy(name, args.binary)
            for i in range(1, REPLAY_KEYS + 1):
                post(stack.url(name), f"replay-{i}")
        def script(workload, name, rep):
            # New keys are new in every repetition (a prefix of its own), or they would replay.
            path = os.path.join(work, f"{workload.replace(' ', '')}-{name}-{rep}.lua")
            with open(path, "w") as f:
                if workload == "new key":
                    f.write(NEWKEY_LUA % (f"k-{name}-r{rep}", REQUEST))
                else:
                    f.write(REPLAY_LUA % (REPLAY_KEYS, REQUEST))
                if args.pace:
                    f.write(f"function delay() return {args.pace} end\n")
            return path

        results = {w: {n: [] for n in STORES} for w in ("new key", "replay")}
        for rep in range(args.reps):
            for workload in results:
                order = STORES if rep % 2 == 0 else tuple(reversed(STORES))
                for name in order:
                    r = run_one(stack, name, args.duration, args.connections, script(workload, name, rep),
                                args.profile)
                    results[workload][name].append(r)
                    print(f"rep {rep + 1} {workload:8} {name:8} " +
                          " ".join(f"{k}={v:.2f}" for k, v in r.items() if k != "requests"), file=sys.stderr)
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)

    paced = f", each waiting {args.pace} ms between requests" if args.pace else ""
    paced += "; pinned: each proxy (one worker) on CPU 1, the rest on CPU 0" if args.pin else ""
    print(f"\n{args.reps} reps x {args.duration}s, {args.connections} connections{paced}, 1 KiB answers; "
          "medians (min-max); ratio = postgres/redis, paired per rep")
    keys = ("proxy_cpu_us", "proxy_switches", "store_cpu_us", "round_trips", "p50_ms", "p99_ms", "rps")
    summary = {}
    for workload, per in results.items():
        print(f"\n{workload}")
        print(f"  {'':14}" + "".join(f"{k:>22}" for k in keys))
        for name in STORES:
            print(f"  {name:14}" + "".join(f"{fmt([r[k] for r in per[name]], 2):>22}" for k in keys))
        ratios = {k: [p[k] / r[k] if r[k] else float('nan') for p, r in zip(per["postgres"], per["redis"])]
                  for k in keys}
        print(f"  {'ratio':14}" + "".join(f"{fmt(ratios[k], 2):>22}" for k in keys))
        summary[workload] = {"runs": per, "ratio_median": {k: statistics.median(v) for k, v in ratios.items()}}
        if args.profile:
            print(f"  where each proxy's CPU goes, us per request (median; perf's samples): "
                  f"{'redis':>8} {'postgres':>9} {'difference':>11}")
            for category, _, _ in PROFILE_RULES:
                k = f"us: {category}"
                r, p = (statistics.median(x[k] for x in per[n]) for n in STORES)
                print(f"    {category:71} {r:8.1f} {p:9.1f} {p - r:+11.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"reps": args.reps, "duration": args.duration, "connections": args.connections,
                       "pace_ms": args.pace, "pin": args.pin, "results": summary}, f, indent=1)
        print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
