#!/usr/bin/env python3
"""Redis's CPU per store operation, with nothing else in the way.

A redis-server of its own pinned to CPU 1 (nothing else runs there); one
client on the other CPU sends each operation the way the proxy's connection
does: batches of 32 in one write, the replies read before the next batch.
For every variant, in turn and for --reps rounds, N operations are sent and
Redis's CPU time (utime + stime from /proc) is divided by N. Prints the
median µs per operation and every round's figure.

Variants: a reserve as the script it was (`bench/reserve.lua`) and as
the two plain commands it is now (`SET NX PX` and `GETRANGE`), each for a
new key and for a key held by a 300-byte record (a replay's or a 409's
reserve); with `PTTL` as a third command (what a 409 would save); `SET NX
PX` alone; and `complete.lua`, the other script of a new key, beside what
bounds it from below on Redis 7: the same script as a function (`FCALL`),
a script that does nothing (`return 1`) sent the same arguments, a script
of complete.lua's `SET` alone (its read left out), and a plain `SET PX` of
the finished record with no owner check.

    bench/redis_ops.py [--reps 3] [--n 100000]
"""

import argparse
import hashlib
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

# The store's reserve as one script, until it became two plain commands.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "reserve.lua"), "rb") as f:
    RESERVE_LUA = f.read()
BATCH = 32
# A script that does nothing: what calling any script costs Redis.
EMPTY_LUA = b"return 1"
# complete.lua's write without its read: a script's one redis.call.
SET_LUA = b"redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1"


def complete_function(script):
    """complete.lua as a Redis 7 function (FUNCTION LOAD): the same body."""
    body = script.decode().replace("KEYS[", "keys[").replace("ARGV[", "args[")
    return ("#!lua name=idemproxy_bench\n"
            "redis.register_function('idemproxy_complete', function(keys, args)\n" + body + "\nend)\n")


def pack(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def reply_end(buf, at):
    """Where the RESP2 reply at `at` ends, or None while it is incomplete."""
    nl = buf.find(b"\r\n", at)
    if nl < 0:
        return None
    kind, line, after = buf[at:at + 1], buf[at + 1:nl], nl + 2
    if kind in (b"+", b"-", b":"):
        return after
    if kind == b"$":
        n = int(line)
        end = after + n + 2
        return after if n < 0 else (end if len(buf) >= end else None)
    if kind == b"*":
        pos = after
        for _ in range(max(int(line), 0)):
            pos = reply_end(buf, pos)
            if pos is None:
                return None
        return pos
    raise ValueError(f"not RESP: {buf[at:at + 20]!r}")


class Client:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, commands):
        """Sends the packed commands in one write and reads their replies."""
        self.sock.sendall(b"".join(commands))
        left = len(commands)
        while left:
            end = reply_end(self.buf, 0)
            if end is None:
                self.buf += self.sock.recv(1 << 20)
                continue
            if self.buf.startswith(b"-"):
                raise RuntimeError(self.buf[:end].decode())
            self.buf = self.buf[end:]
            left -= 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    port = bench.free_port()
    redis = subprocess.Popen(["taskset", "-c", "1", "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        bench.wait_port(port)
        run(Client(port), redis.pid, args)
    finally:
        redis.terminate()
        redis.wait()


def run(client, pid, args):
    with open(os.path.join(bench.ROOT, "src", "store", "complete.lua"), "rb") as f:
        complete_lua = f.read()
    client.send([pack("SCRIPT", "LOAD", RESERVE_LUA), pack("SCRIPT", "LOAD", complete_lua),
                 pack("SCRIPT", "LOAD", EMPTY_LUA), pack("SCRIPT", "LOAD", SET_LUA),
                 pack("FUNCTION", "LOAD", "REPLACE", complete_function(complete_lua))])
    reserve_sha, complete_sha, empty_sha, set_sha = (hashlib.sha1(s).hexdigest()
                                                     for s in (RESERVE_LUA, complete_lua, EMPTY_LUA, SET_LUA))
    token = b"T" * 16
    processing = b"\x01P" + token + b"p" * 80
    finished = b"\x01F" + token + b"f" * 280
    variants = {
        "reserve.lua, new key": lambda k: [pack("EVALSHA", reserve_sha, 1, k, processing, 30000, 65536)],
        "SET NX PX + GETRANGE, new key": lambda k: [pack("SET", k, processing, "NX", "PX", 30000),
                                                    pack("GETRANGE", k, 0, 65535)],
        "  + PTTL, new key": lambda k: [pack("SET", k, processing, "NX", "PX", 30000),
                                        pack("GETRANGE", k, 0, 65535), pack("PTTL", k)],
        "SET NX PX alone, new key": lambda k: [pack("SET", k, processing, "NX", "PX", 30000)],
        "reserve.lua, held key": lambda k: [pack("EVALSHA", reserve_sha, 1, "held", processing, 30000, 65536)],
        "SET NX PX + GETRANGE, held key": lambda k: [pack("SET", "held", processing, "NX", "PX", 30000),
                                                     pack("GETRANGE", "held", 0, 65535)],
        "  + PTTL, held key": lambda k: [pack("SET", "held", processing, "NX", "PX", 30000),
                                         pack("GETRANGE", "held", 0, 65535), pack("PTTL", "held")],
        "complete.lua (after a reserve)": lambda k: [pack("EVALSHA", complete_sha, 1, k, token, finished, 86400000)],
        "  as a function (FCALL)": lambda k: [pack("FCALL", "idemproxy_complete", 1, k, token, finished, 86400000)],
        "  an empty script, same arguments": lambda k: [pack("EVALSHA", empty_sha, 1, k, token, finished, 86400000)],
        "  a script of its SET alone": lambda k: [pack("EVALSHA", set_sha, 1, k, token, finished, 86400000)],
        "  SET PX alone, no owner check": lambda k: [pack("SET", k, finished, "PX", 86400000)],
    }
    # These run on keys that hold a reservation, as a completion does.
    completions = list(variants)[list(variants).index("complete.lua (after a reserve)"):]
    figures = {name: [] for name in variants}
    for rep in range(args.reps):
        for name, commands in variants.items():
            client.send([pack("FLUSHALL"), pack("SET", "held", finished)])
            keys = [f"k{i}" for i in range(args.n)]
            if name in completions:
                for i in range(0, args.n, BATCH):
                    client.send([pack("SET", k, processing, "PX", 30000) for k in keys[i:i + BATCH]])
            before = bench.cpu_seconds([pid])
            for i in range(0, args.n, BATCH):
                client.send([c for k in keys[i:i + BATCH] for c in commands(k)])
            figures[name].append((bench.cpu_seconds([pid]) - before) / args.n * 1e6)
        print(f"round {rep + 1}/{args.reps} done", file=sys.stderr)
    print(f"\n{'operation (Redis on CPU 1, batches of 32)':42} {'µs/op':>7}  rounds")
    for name, values in figures.items():
        median = sorted(values)[len(values) // 2]
        print(f"{name:42} {median:7.2f}  " + " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
