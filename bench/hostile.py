#!/usr/bin/env python3
"""idemproxy under hostile load (the hostile-conditions requirements, issue 10 "Show").

Starts, on loopback ports of its own: a redis-server, an upstream of its own
(a "legacy payments API" that counts executions per Idempotency-Key and can
answer with an 8 MiB body; the demo upstream can do neither), and, for each
scenario, a fresh idemproxy (release build, Redis store, defaults except two
protected routes). Scenarios:

  (a) 500 stalled 1 MiB uploads: a protected POST with Content-Length 1 MiB,
      all but the last 64 KiB of the body sent, then nothing;
  (b) 200 clients that never read an 8 MiB replay (SO_RCVBUF 4 KiB), all at
      once; (b') the same 200 arriving 10 every 200 ms;
  (c) 10,000 idle keep-alive connections (each sent one GET), or as many as
      RLIMIT_NOFILE allows;
  (d) (a) + (b) + 2,000 idle connections at once;
  (e) HTTP/2: 100 non-reading connections × 200 streams;
  (f) HTTP/2: 10 connections send waves of 100 protected requests each to
      a slow route (the upstream takes 3 s) and reset every stream
      (RST_STREAM) 0.3 s later, five waves;
  (g) HTTP/2: 20 connections whose streams have a window of 0
      (SETTINGS_INITIAL_WINDOW_SIZE 0), each asking for the 8 MiB replay on
      100 streams and never opening a window, a PING every second keeping
      the connection lively (client_write_timeout 5 s in this scenario);
  (h) HTTP/1.1: waves of 300 connections that send a protected request to
      the slow route and hang up 0.3 s later, five waves;
  (i) large records with a slow store: the proxy reaches Redis through a
      relay of the script's own that delays every chunk by 10 ms each way;
      20 clients send protected POST /v1/big (8 MiB answers) with new keys,
      each followed by its retry, for the whole of the legitimate clients'
      run; every retry's answer is checked byte for byte against the first.

In every scenario, once the attack has built up, a legitimate client sends
protected requests (a new key, then a retry of it) in a loop, twice over:
one on a keep-alive connection opened before the attack, one that connects
after it. Then all attack sockets are closed and the time until a new
protected request gets a fresh 201 and `idemproxy_buffered_bytes` reads 0 is
measured. Per scenario: peak RSS of the proxy (VmRSS polled every 20 ms, and
VmHWM), the legitimate client's answers, executions per key at the upstream,
whether the proxy died.

Prints a table of measured values against the issue's targets and writes
bench/results/hostile.json. Figures only; nothing here asserts.

    bench/hostile.py [--only abpcdefghi] [--idle 10000] [--mixed-idle 2000]
                     [--big-clients 20] [--relay-ms 10] [--no-build | --bin PATH]

HOSTILE_RUST_LOG=info keeps the proxy's access log; HOSTILE_KEEP=1 keeps the
temp dir (configs and proxy logs).

Needs: redis-server, python3, cargo (builds target/release/idemproxy).
"""

import argparse
import collections
import errno
import hashlib
import http.client
import json
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024 * 1024
MAX_BUFFERED = 64 * MIB  # the default of [server] max_buffered
BIG = 8 * MIB  # the large answer of /v1/big
UPLOAD = 1 * MIB  # Content-Length of a stalled upload (= the default max_request_body)
STALL_SHORT = 64 * 1024  # bytes of the upload never sent
LEGIT_TIMEOUT = 3.0  # the legitimate client's per-request timeout, seconds
LEGIT_SECONDS = 6.0  # how long the legitimate client runs during an attack
RECOVERY_DEADLINE = 20.0
SLOW_S = 3.0  # how long the upstream takes over POST /v1/slow
BIG_TIMEOUT = 30.0  # (i)'s attackers' per-request timeout, seconds
MAX_CONNECTIONS = 256  # the default of [server] max_connections: places per protocol


# ---------------------------------------------------------------------------
# The upstream: run as a child process (`--serve-upstream PORT`) so that it
# shares no interpreter lock with the attack.

class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    counts = collections.Counter()
    lock = threading.Lock()
    pad = b"x" * BIG
    # POST /v1/slow exchanges under way, and the most at once since the last reset.
    active = 0
    peak = 0

    def log_message(self, *args):
        pass

    def _answer(self, status, body, ctype="application/json", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(sum(len(b) for b in body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        for b in body:
            self.wfile.write(b)

    def do_GET(self):
        if self.path == "/counts":
            with self.lock:
                data = json.dumps(dict(self.counts)).encode()
            self._answer(200, [data])
        elif self.path.startswith("/active"):
            with self.lock:
                data = json.dumps({"active": Upstream.active, "peak": Upstream.peak}).encode()
                if self.path.endswith("?reset=1"):
                    Upstream.peak = Upstream.active
            self._answer(200, [data])
        else:
            self._answer(200, [b'{"ok":true}'])

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        key = self.headers.get("Idempotency-Key", "")
        with self.lock:
            self.counts[key] += 1
            n = self.counts[key]
        head = json.dumps({"key": key, "execution": n})[:-1].encode()
        if self.path == "/v1/slow":
            with self.lock:
                Upstream.active += 1
                Upstream.peak = max(Upstream.peak, Upstream.active)
            try:
                time.sleep(SLOW_S)
                self._answer(201, [head + b"}"])
            finally:
                with self.lock:
                    Upstream.active -= 1
        elif self.path == "/v1/big":
            # {"key":..,"execution":n,"pad":"xxx..."}: exactly BIG bytes.
            prefix = head + b',"pad":"'
            self._answer(201, [prefix, memoryview(self.pad)[: BIG - len(prefix) - 2], b'"}'])
        else:
            self._answer(201, [head + b"}"], extra=[("Location", f"/v1/payments/{n}")])


class UpstreamServer(ThreadingHTTPServer):
    request_queue_size = 4096
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A proxy that drops an answer it relays (its client gone) resets the
        # upstream connection: expected under attack, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def serve_upstream(port):
    UpstreamServer(("127.0.0.1", port), Upstream).serve_forever()


# ---------------------------------------------------------------------------
# A slow store for (i): a TCP relay in front of the redis-server, run as a
# child process (`--serve-relay LISTEN:TARGET:DELAY_MS`, asyncio, loopback
# only). Every chunk read on one side is written to the other DELAY_MS after
# it was read: per direction, a queue of (due time, chunk) and a task that
# writes each chunk at its due time, so a chunk waits its own delay and never
# the delays of the chunks before it (latency added, not bandwidth taken).

def serve_relay(spec):
    import asyncio
    listen, target, delay_ms = (int(x) for x in spec.split(":"))
    delay = delay_ms / 1000.0

    async def pipe(reader, writer):
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()

        async def deliver():
            try:
                while True:
                    due, data = await queue.get()
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if not data:
                        break
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(256 * 1024)
                queue.put_nowait((loop.time() + delay, data))
                if not data:
                    break
        except (ConnectionError, OSError):
            queue.put_nowait((0.0, b""))
        await task

    async def handle(client_r, client_w):
        try:
            store_r, store_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, store_w), pipe(store_r, client_w))

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", listen, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class Relay:
    """The relay of (i) as a child process, in front of redis_port."""

    def __init__(self, redis_port, delay_ms):
        self.port, self.delay_ms = free_port(), delay_ms
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-relay",
                                      f"{self.port}:{redis_port}:{delay_ms}"])
        wait_port(self.port)

    def ping_ms(self, n=5):
        """Median round trip of a Redis PING through the relay, ms."""
        times = []
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            for _ in range(n):
                t0 = time.monotonic()
                s.sendall(b"PING\r\n")
                got = b""
                while not got.endswith(b"\r\n"):
                    got += s.recv(64)
                times.append((time.monotonic() - t0) * 1000)
        return round(sorted(times)[n // 2], 1)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------
# Helpers in bench.py's style.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, deadline=10.0):
    end = time.time() + deadline
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on port {port}")


def wait_http(url, deadline=15.0):
    end = time.time() + deadline
    while time.time() < end:
        try:
            if urllib.request.urlopen(url, timeout=0.5).status == 200:
                return
        except Exception:
            time.sleep(0.05)
    sys.exit(f"{url} never answered 200")


def proc_status(pid, field):
    """A kB figure from /proc/PID/status, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class RssSampler(threading.Thread):
    """Polls VmRSS every 20 ms; keeps the peak and a coarse time series."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.samples, self.stop_flag = pid, 0, [], threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        last_kept = -1.0
        while not self.stop_flag.is_set():
            v = proc_status(self.pid, "VmRSS")
            if v is None:
                return
            self.peak_kib = max(self.peak_kib, v)
            t = time.monotonic() - self.t0
            if t - last_kept >= 0.5:
                self.samples.append((round(t, 2), v))
                last_kept = t
            time.sleep(0.02)

    def stop(self):
        self.stop_flag.set()
        self.join()


class Proxy:
    """A fresh idemproxy for one scenario."""

    def __init__(self, workdir, name, idem_bin, upstream_port, redis_port, extra=""):
        self.port, self.admin_port = free_port(), free_port()
        self.upstream_port = upstream_port
        cfg = os.path.join(workdir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
listen = "127.0.0.1:{self.port}"
admin_listen = "127.0.0.1:{self.admin_port}"
upstream = "http://127.0.0.1:{upstream_port}"
{os.environ.get("HOSTILE_SERVER_EXTRA", "")}
{extra}

[store]
backend = "redis"
url = "redis://127.0.0.1:{redis_port}/0"
key_prefix = "hostile-{name}"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "big"
path = "/v1/big"
max_response_body = "16MiB"

[[routes]]
name = "slow"
path = "/v1/slow"
""")
        self.stderr_path = os.path.join(workdir, f"{name}.stderr")
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([idem_bin, "--config", cfg], stdout=subprocess.DEVNULL,
                                     stderr=self.stderr, env=dict(os.environ, RUST_LOG=os.environ.get("HOSTILE_RUST_LOG", "warn")))
        wait_port(self.port)
        wait_http(f"http://127.0.0.1:{self.admin_port}/readyz")
        self.rss = RssSampler(self.proc.pid)
        self.rss.start()

    def gauge(self):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=2).read().decode()
        except Exception:
            return None
        m = re.search(r"^idemproxy_buffered_bytes (\d+)", text, re.M)
        return int(m.group(1)) if m else None

    def alive(self):
        return self.proc.poll() is None

    def finish(self):
        """Stops the sampler, reads VmHWM, stops the proxy; what happened to it."""
        hwm = proc_status(self.proc.pid, "VmHWM")
        self.rss.stop()
        died = self.proc.poll()
        if died is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = "killed after 30 s"
        else:
            code = died
        self.stderr.close()
        with open(self.stderr_path, errors="replace") as f:
            log = f.read()
        levels = collections.Counter(re.findall(r"\b(WARN|ERROR)\b", log))
        return {
            "crashed": died is not None,
            "exit_code_during_run": died,
            "exit_code_after_sigterm": code,
            "peak_rss_kib": self.rss.peak_kib,
            "vmhwm_kib": hwm,
            "rss_series_kib": self.rss.samples,
            "log_warn": levels.get("WARN", 0),
            "log_error": levels.get("ERROR", 0),
            "panics": log.count("panicked"),
            "log_tail": log.strip().splitlines()[-5:],
        }


# ---------------------------------------------------------------------------
# Raw sockets for the attacks: non-blocking, driven by one epoll loop.

class Conn:
    __slots__ = ("sock", "segments", "seg", "off", "connected", "read", "inbuf", "closed", "error", "closed_at")

    def __init__(self, sock, segments, read):
        self.sock, self.segments, self.seg, self.off = sock, segments, 0, 0
        self.connected, self.read, self.inbuf, self.closed, self.error = False, read, b"", False, None
        self.closed_at = None  # time.monotonic() when the proxy closed it

    def pending(self):
        return self.seg < len(self.segments)

    def status(self):
        m = re.match(rb"HTTP/1\.1 (\d{3})", self.inbuf)
        return int(m.group(1)) if m else None

    def problem(self):
        return problem_type(self.inbuf)


def problem_type(data):
    """The problem `type` an answer's body names (its last path segment), or None."""
    m = re.search(rb'"type":"([^"]+)"', data)
    return m.group(1).decode().rsplit("/", 1)[-1] if m else None


def open_conns(port, n, segments_of, read=True, rcvbuf=None):
    conns = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            # Before connect, so the window the proxy sees is small from the start.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.setblocking(False)
        rc = s.connect_ex(("127.0.0.1", port))
        c = Conn(s, segments_of(i), read)
        if rc not in (0, errno.EINPROGRESS):
            c.error = errno.errorcode.get(rc, str(rc))
        conns.append(c)
    return conns


def drive(conns, seconds, done=lambda: False, tick=None):
    """Connects, sends every connection's segments as the peer accepts them and
    (where `read`) keeps at most 4 KiB of what comes back, for `seconds` or
    until `done()`; `tick()` (which may append segments) every round."""
    sel = selectors.DefaultSelector()
    want = {}

    def update(c):
        ev = 0
        if not c.closed and c.error is None:
            if not c.connected or c.pending():
                ev |= selectors.EVENT_WRITE
            if c.read and c.connected:
                ev |= selectors.EVENT_READ
        old = want.get(c.sock, 0)
        if ev == old:
            return
        if old and ev:
            sel.modify(c.sock, ev, c)
        elif old:
            sel.unregister(c.sock)
        else:
            sel.register(c.sock, ev, c)
        if ev:
            want[c.sock] = ev
        else:
            want.pop(c.sock, None)

    for c in conns:
        update(c)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not done():
        if tick:
            tick()
            for c in conns:
                update(c)
        for key, ev in sel.select(timeout=0.05):
            c = key.data
            if ev & selectors.EVENT_WRITE:
                if not c.connected:
                    err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        c.error = errno.errorcode.get(err, str(err))
                    else:
                        c.connected = True
                while c.connected and c.pending():
                    seg = c.segments[c.seg]
                    try:
                        k = c.sock.send(seg[c.off:c.off + 256 * 1024])
                    except BlockingIOError:
                        break
                    except OSError as e:
                        c.error = errno.errorcode.get(e.errno, str(e))
                        try:  # an answer sent before the proxy hung up may still be readable
                            c.inbuf += c.sock.recv(4096)
                        except OSError:
                            pass
                        break
                    c.off += k
                    if c.off >= len(seg):
                        c.seg, c.off = c.seg + 1, 0
            if ev & selectors.EVENT_READ:
                try:
                    data = c.sock.recv(65536)
                except BlockingIOError:
                    data = None
                except OSError as e:
                    c.error, data = errno.errorcode.get(e.errno, str(e)), None
                if data == b"" or (data is None and c.error):
                    c.closed = True
                    c.closed_at = c.closed_at or time.monotonic()
                elif data and len(c.inbuf) < 4096:
                    c.inbuf += data[: 4096 - len(c.inbuf)]
            update(c)
    sel.close()


def close_all(conns):
    for c in conns:
        try:
            c.sock.close()
        except OSError:
            pass


def summarize(conns, sent_bytes=None):
    """How the attack connections fared: connected, fully sent, answers by status/type, errors."""
    out = collections.Counter()
    for c in conns:
        if c.error:
            out[f"error {c.error}"] += 1
        elif not c.connected:
            out["not connected (backlog)"] += 1
        st = c.status()
        if st:
            pt = c.problem()
            out[f"answered {st}" + (f" {pt}" if pt else "")] += 1
        elif c.connected and not c.error:
            out["no answer" + (" (closed)" if c.closed else "")] += 1
        if c.connected and not c.pending():
            out["request sent"] += 1
    return dict(out)


# ---------------------------------------------------------------------------
# The legitimate client.

class Legit(threading.Thread):
    """Protected requests in a loop: a new key, then a retry of it. `early`
    opens its keep-alive connection now (before the attack); otherwise the
    first connection is made when it starts."""

    def __init__(self, port, tag, early):
        super().__init__(daemon=True)
        self.port, self.tag, self.conn = port, tag, None
        self.outcomes, self.wrong, self.keys = collections.Counter(), 0, []
        self.stop_flag = threading.Event()
        if early:
            self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=LEGIT_TIMEOUT)
            self.conn.connect()

    def request(self, key, body):
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=LEGIT_TIMEOUT)
        try:
            self.conn.request("POST", "/v1/payments", body=body,
                              headers={"Idempotency-Key": key, "Content-Type": "application/json"})
            r = self.conn.getresponse()
            data = r.read()
            if r.getheader("Connection", "").lower() == "close":
                self.conn.close()
                self.conn = None
        except socket.timeout:
            self.conn.close()
            self.conn = None
            return "timeout"
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            self.conn = None
            return f"error {type(e).__name__}"
        label = str(r.status)
        if r.getheader("Idempotent-Replayed") == "true":
            label += " replay"
        if r.status == 201:
            try:
                if json.loads(data)["key"] != key:
                    self.wrong += 1
            except (ValueError, KeyError):
                self.wrong += 1
        else:
            kind = problem_type(data)
            if kind:
                label += " " + kind
        return label

    def run(self):
        i = 0
        while not self.stop_flag.is_set():
            i += 1
            key = f"{self.tag}-{i}"
            self.keys.append(key)
            body = json.dumps({"amount": i})
            self.outcomes["new: " + self.request(key, body)] += 1
            if self.stop_flag.is_set():
                break
            self.outcomes["retry: " + self.request(key, body)] += 1
            self.stop_flag.wait(0.02)

    def stop(self):
        self.stop_flag.set()
        self.join(timeout=LEGIT_TIMEOUT * 3)
        if self.conn:
            self.conn.close()


def one_post(port, key, path="/v1/payments", timeout=2.0):
    """(status, replayed, body) of one protected POST on a new connection; status None on failure."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=b'{"amount":1}',
                  headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.getheader("Idempotent-Replayed"), r.read()
    except (OSError, http.client.HTTPException):
        return None, None, b""
    finally:
        c.close()


def recovery(proxy, tag):
    """Seconds from now until a new key gets a fresh 201 and the gauge reads 0 (both)."""
    t0 = time.monotonic()
    t_201 = t_zero = None
    i = 0
    while time.monotonic() - t0 < RECOVERY_DEADLINE and (t_201 is None or t_zero is None):
        if t_zero is None and proxy.gauge() == 0:
            t_zero = time.monotonic() - t0
        if t_201 is None:
            i += 1
            status, replayed, _ = one_post(proxy.port, f"{tag}-recover-{i}")
            if status == 201 and replayed is None:
                t_201 = time.monotonic() - t0
    both = max(t_201, t_zero) if t_201 is not None and t_zero is not None else None
    return {"fresh_201_s": t_201, "gauge_zero_s": t_zero, "full_service_s": both, "probes": i}


def wait_plateau(proxy, seconds=8.0):
    """Waits until the budget gauge stops moving (5 equal reads 100 ms apart), at most `seconds`."""
    end, last, same = time.monotonic() + seconds, None, 0
    while time.monotonic() < end and same < 5:
        g = proxy.gauge()
        same = same + 1 if g == last else 0
        last = g
        time.sleep(0.1)
    return last


def slow_exchanges(port, reset=False):
    """The upstream's POST /v1/slow exchanges under way and the most at once (since the last reset)."""
    url = f"http://127.0.0.1:{port}/active" + ("?reset=1" if reset else "")
    return json.loads(urllib.request.urlopen(url, timeout=5).read())


def upstream_counts(port):
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/counts", timeout=5).read())


# ---------------------------------------------------------------------------
# Attack builders.

def stalled_uploads(port, n, tag):
    body = memoryview(bytes(UPLOAD - STALL_SHORT))

    def segments(i):
        head = (f"POST /v1/payments HTTP/1.1\r\nHost: hostile\r\nIdempotency-Key: {tag}-stall-{i}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {UPLOAD}\r\n\r\n").encode()
        return [head, body]
    return open_conns(port, n, segments)


def non_readers(port, n, key):
    req = (f"POST /v1/big HTTP/1.1\r\nHost: hostile\r\nIdempotency-Key: {key}\r\n"
           f"Content-Type: application/json\r\nContent-Length: 12\r\n\r\n" + '{"amount":1}').encode()
    return open_conns(port, n, lambda i: [req], read=False, rcvbuf=4096)


def idle_conns(port, n):
    req = b"GET /health HTTP/1.1\r\nHost: hostile\r\n\r\n"
    return open_conns(port, n, lambda i: [req])


# HTTP/2 (§9: the §8 bounds per stream), frames written by hand: HPACK
# literals without indexing or Huffman, so that no library hides what is sent.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def h2_str(b):
    assert len(b) < 127
    return bytes([len(b)]) + b


def h2_post(path, key, length):
    """A POST's header block: :method POST, :scheme http, :path, :authority, idempotency-key, content-length."""
    block = b"\x83\x86" + b"\x04" + h2_str(path.encode()) + b"\x01" + h2_str(b"hostile")
    block += b"\x00" + h2_str(b"idempotency-key") + h2_str(key.encode())
    block += b"\x0f\x0d" + h2_str(str(length).encode())
    return block


def h2_attackers(port, n, streams, tag, big_key):
    """n HTTP/2 connections that never read, each opening `streams` streams
    (the first 100 are served, the rest refused): even streams are stalled
    1 MiB uploads (Content-Length 1 MiB, 512 bytes sent), odd ones retries of
    the stored 8 MiB answer."""
    retry = b'{"amount":1}'

    def segments(i):
        out = H2_PREFACE + h2_frame(0x4, 0, 0)
        for j in range(streams):
            sid = 2 * j + 1
            if j % 2 == 0:
                out += h2_frame(0x1, 0x4, sid, h2_post("/v1/payments", f"{tag}-h2-{i}-{j}", UPLOAD))
                out += h2_frame(0x0, 0, sid, bytes(512))
            else:
                out += h2_frame(0x1, 0x4, sid, h2_post("/v1/big", big_key, len(retry)))
                out += h2_frame(0x0, 0x1, sid, retry)
        return [out]
    return open_conns(port, n, segments, read=False, rcvbuf=4096)


H2_RESET_CANCEL = (0x8).to_bytes(4, "big")
SLOW_BODY = b'{"amount":1}'


def h2_slow(sid, key):
    """HEADERS and DATA (END_STREAM) of a protected POST /v1/slow on stream `sid`."""
    return (h2_frame(0x1, 0x4, sid, h2_post("/v1/slow", key, len(SLOW_BODY)))
            + h2_frame(0x0, 0x1, sid, SLOW_BODY))


def all_sent(conns):
    return lambda: all(c.error or c.closed or (c.connected and not c.pending()) for c in conns)


def store_big(port, key):
    status, replayed, body = one_post(port, key, "/v1/big", timeout=30)
    return status, len(body)


def all_answered(conns):
    return lambda: all(c.error or c.closed or c.status() for c in conns)


# ---------------------------------------------------------------------------
# Scenarios.

def run_scenario(name, label, ctx, build):
    """Starts a proxy, lets `build` set the attack up (it returns the attack's
    connections and notes), runs the legitimate clients, closes the attack,
    measures recovery, checks executions."""
    print(f"[{name}] {label}", file=sys.stderr, flush=True)
    # A scenario may put the store behind a slow relay (build.relay_delay_ms).
    relay, store_notes = None, {}
    if getattr(build, "relay_delay_ms", None) is not None:
        relay = Relay(ctx["redis_port"], build.relay_delay_ms)
        store_notes = {"store_relay_delay_ms": relay.delay_ms, "store_ping_ms_through_relay": relay.ping_ms()}
    proxy = Proxy(ctx["workdir"], name, ctx["idem_bin"], ctx["upstream_port"],
                  relay.port if relay else ctx["redis_port"], getattr(build, "extra", ""))
    slow_exchanges(ctx["upstream_port"], reset=True)
    tag = f"{name}{time.time_ns()}"
    idle_rss = proc_status(proxy.proc.pid, "VmRSS")
    early = Legit(proxy.port, f"{tag}-legit-early", early=True)
    t_start = time.monotonic()
    conns, notes = build(proxy, tag)
    notes.update(store_notes)
    tick = notes.pop("tick", None)
    # An attack that is traffic (not held sockets) goes on during the
    # legitimate clients' run; `stop()` ends it and returns its figures.
    stop_attack = notes.pop("stop", None)
    t_ready = time.monotonic()
    notes["attack_build_s"] = round(t_ready - t_start, 2)
    notes["gauge_after_build"] = proxy.gauge()
    # Such traffic keeps the gauge moving: no plateau to wait for.
    notes["gauge_under_attack"] = proxy.gauge() if stop_attack else wait_plateau(proxy)
    late = Legit(proxy.port, f"{tag}-legit-late", early=False)
    early.start()
    late.start()
    # The attack holds while the legitimate clients run; its sockets stay
    # serviced (reads drained where the scenario reads) so nothing else moves.
    drive(conns, LEGIT_SECONDS, tick=tick)
    early.stop()
    late.stop()
    notes["gauge_at_end_of_attack"] = proxy.gauge()
    notes["attack_connections"] = summarize(conns)
    closed = sorted(round(c.closed_at - t_ready, 2) for c in conns if c.closed_at)
    if closed:
        notes["closed_by_proxy_after_build_s"] = {"count": len(closed), "first": closed[0], "last": closed[-1]}
    notes["upstream_slow_exchanges"] = slow_exchanges(ctx["upstream_port"])
    alive_before_close = proxy.alive()
    if stop_attack:
        notes.update(stop_attack())
    close_all(conns)
    rec = recovery(proxy, tag) if proxy.alive() else {"full_service_s": None}
    counts = upstream_counts(ctx["upstream_port"])
    mine = {k: v for k, v in counts.items() if k.startswith(tag)}
    twice = {k: v for k, v in mine.items() if v > 1}
    legit_fresh = sum(v for k, v in early.outcomes.items() if k.startswith("new: 201") and "replay" not in k) + \
        sum(v for k, v in late.outcomes.items() if k.startswith("new: 201") and "replay" not in k)
    fate = proxy.finish()
    if relay:
        relay.stop()
    result = {
        "label": label,
        "idle_rss_kib": idle_rss,
        **fate,
        "alive_when_attack_closed": alive_before_close,
        "legit_keepalive_before_attack": dict(early.outcomes),
        "legit_connects_during_attack": dict(late.outcomes),
        "legit_wrong_answers": early.wrong + late.wrong,
        "legit_fresh_201": legit_fresh,
        "recovery": rec,
        "keys_executed": len(mine),
        "keys_executed_twice": twice,
        **notes,
    }
    print(f"[{name}] peak RSS {fate['peak_rss_kib'] / 1024:.1f} MiB (VmHWM {(fate['vmhwm_kib'] or 0) / 1024:.1f}), "
          f"recovery {rec.get('full_service_s')}, crashed {fate['crashed']}, executed twice {len(twice)}",
          file=sys.stderr, flush=True)
    return result


def scenario_f(n=10, per_wave=100, waves=5, gap=0.3):
    """HTTP/2 streams reset once their requests are under way, wave after wave."""
    def build(proxy, tag):
        conns = open_conns(proxy.port, n, lambda i: [H2_PREFACE + h2_frame(0x4, 0, 0)])
        sids = [1] * n
        for _ in range(waves):
            opened = []
            for i, c in enumerate(conns):
                ids = list(range(sids[i], sids[i] + 2 * per_wave, 2))
                sids[i] += 2 * per_wave
                c.segments.append(b"".join(h2_slow(sid, f"{tag}-rst-{i}-{sid}") for sid in ids))
                opened.append(ids)
            drive(conns, 5, done=all_sent(conns))
            drive(conns, gap)  # under way at the upstream (answers drained)
            for c, ids in zip(conns, opened):
                c.segments.append(b"".join(h2_frame(0x3, 0, sid, H2_RESET_CANCEL) for sid in ids))
            drive(conns, 5, done=all_sent(conns))
        return conns, {"attack": f"HTTP/2: {n} connections, {waves} waves of {per_wave} streams each to a "
                                 f"{SLOW_S:.0f} s route, every stream reset {gap} s after it was sent",
                       "upstream_exchanges_right_after": slow_exchanges(proxy.upstream_port)}
    return build


def scenario_g(n=20, streams=100, ping_every=1.0, write_timeout="5s"):
    """HTTP/2 streams whose window stays shut, on connections kept lively by pings."""
    def build(proxy, tag):
        key = f"{tag}-big"
        status, length = store_big(proxy.port, key)
        window_zero = h2_frame(0x4, 0, 0, (0x4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
        retry = b'{"amount":1}'

        def segments(i):
            out = H2_PREFACE + window_zero
            for j in range(streams):
                sid = 2 * j + 1
                out += h2_frame(0x1, 0x4, sid, h2_post("/v1/big", key, len(retry)))
                out += h2_frame(0x0, 0x1, sid, retry)
            return [out]
        conns = open_conns(proxy.port, n, segments)
        last_ping = [time.monotonic()]

        def ping():
            if time.monotonic() - last_ping[0] >= ping_every:
                last_ping[0] = time.monotonic()
                for c in conns:
                    if not (c.closed or c.error):
                        c.segments.append(h2_frame(0x6, 0, 0, bytes(8)))
        drive(conns, 10, done=all_sent(conns), tick=ping)
        return conns, {"attack": f"HTTP/2: {n} connections × {streams} retries of an 8 MiB answer, stream "
                                 f"window 0, a PING every {ping_every} s; client_write_timeout {write_timeout}",
                       "big_store": [status, length], "tick": ping}
    build.extra = f'client_write_timeout = "{write_timeout}"'
    return build


def scenario_h(n=300, waves=5, gap=0.3):
    """HTTP/1.1 clients that hang up once their requests are under way, wave after wave."""
    def build(proxy, tag):
        def segments_of(w):
            return lambda i: [(f"POST /v1/slow HTTP/1.1\r\nHost: hostile\r\nIdempotency-Key: {tag}-gone-{w}-{i}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {len(SLOW_BODY)}\r\n\r\n").encode()
                              + SLOW_BODY]
        answered = collections.Counter()
        for w in range(waves):
            conns = open_conns(proxy.port, n, segments_of(w))
            drive(conns, 5, done=all_sent(conns))
            drive(conns, gap)
            for c in conns:
                answered[c.status() or "none"] += 1
            close_all(conns)
        return [], {"attack": f"HTTP/1.1: {waves} waves of {n} connections to a {SLOW_S:.0f} s route, "
                              f"each hanging up {gap} s after sending",
                    "answered_before_hang_up": dict(answered),
                    "upstream_exchanges_right_after": slow_exchanges(proxy.upstream_port)}
    return build


def scenario_a(n=500):
    def build(proxy, tag):
        conns = stalled_uploads(proxy.port, n, tag)
        # Until every upload has sent all it will send (or was answered/cut off), at most 15 s.
        drive(conns, 15, done=lambda: all(c.error or c.closed or c.status() or not c.pending() for c in conns))
        return conns, {"attack": f"{n} stalled uploads (Content-Length {UPLOAD}, {UPLOAD - STALL_SHORT} sent)"}
    return build


def scenario_b(n=200):
    def build(proxy, tag):
        key = f"{tag}-big"
        status, length = store_big(proxy.port, key)
        conns = non_readers(proxy.port, n, key)
        drive(conns, 10, done=lambda: all(c.error or (c.connected and not c.pending()) for c in conns))
        return conns, {"attack": f"{n} non-reading retries of an 8 MiB answer", "big_store": [status, length]}
    return build


def scenario_b_paced(n=200, wave=10, every=0.2):
    """(b) with the retries spread out, so that the store answers them and the
    replays themselves (not the store round trips) meet the memory budget."""
    def build(proxy, tag):
        key = f"{tag}-big"
        status, length = store_big(proxy.port, key)
        conns = []
        for _ in range(0, n, wave):
            batch = non_readers(proxy.port, wave, key)
            drive(batch, 5, done=lambda: all(c.error or (c.connected and not c.pending()) for c in batch))
            conns += batch
            time.sleep(every)
        return conns, {"attack": f"{n} non-reading retries of an 8 MiB answer, {wave} every {every} s",
                       "big_store": [status, length]}
    return build


def scenario_c(n):
    def build(proxy, tag):
        conns = idle_conns(proxy.port, n)
        drive(conns, 15, done=all_answered(conns))
        return conns, {"attack": f"{n} idle keep-alive connections (one GET each)", "idle_requested": n}
    return build


def scenario_d(uploads=500, readers=200, idle=2000):
    def build(proxy, tag):
        key = f"{tag}-big"
        status, length = store_big(proxy.port, key)
        nr = non_readers(proxy.port, readers, key)
        drive(nr, 10, done=lambda: all(c.error or (c.connected and not c.pending()) for c in nr))
        up = stalled_uploads(proxy.port, uploads, tag)
        drive(nr + up, 15, done=lambda: all(c.error or c.closed or c.status() or not c.pending() for c in up))
        idl = idle_conns(proxy.port, idle)
        drive(nr + up + idl, 10, done=all_answered(idl))
        parts = {"non_readers": summarize(nr), "uploads": summarize(up), "idle": summarize(idl)}
        return nr + up + idl, {"attack": f"{readers} non-readers + {uploads} stalled uploads + {idle} idle",
                               "big_store": [status, length], "parts_after_build": parts}
    return build


def scenario_e(n=100, streams=200):
    def build(proxy, tag):
        key = f"{tag}-big"
        status, length = store_big(proxy.port, key)
        conns = h2_attackers(proxy.port, n, streams, tag, key)
        drive(conns, 10, done=lambda: all(c.error or (c.connected and not c.pending()) for c in conns))
        return conns, {"attack": f"HTTP/2: {n} non-reading connections × {streams} streams "
                                 "(stalled 1 MiB uploads and retries of an 8 MiB answer)",
                       "big_store": [status, length]}
    return build


class BigClient(threading.Thread):
    """(i)'s attacker: on one keep-alive connection, protected POST /v1/big
    with a new key, then the retry of that key, over and over until stopped.
    A fresh 201 must be the whole 8 MiB answer naming its key; a retry's
    replay must be that answer again, byte for byte (length and SHA-256)."""

    def __init__(self, port, tag, stop_flag):
        super().__init__(daemon=True)
        self.port, self.tag, self.stop_flag = port, tag, stop_flag
        self.conn, self.lock = None, threading.Lock()
        self.outcomes, self.keys = collections.Counter(), []
        self.replay_s = []  # seconds per full replay

    def post(self, key):
        """(label, status, replayed, body); label None when answered."""
        with self.lock:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=BIG_TIMEOUT)
            conn = self.conn
        try:
            conn.request("POST", "/v1/big", body=b'{"amount":1}',
                         headers={"Idempotency-Key": key, "Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.getheader("Connection", "").lower() == "close":
                self.drop()
        except socket.timeout:
            self.drop()
            return "timeout", None, None, b""
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            if self.stop_flag.is_set():
                return "cut off when the attack stopped", None, None, b""
            return f"error {type(e).__name__}", None, None, b""
        return None, r.status, r.getheader("Idempotent-Replayed") == "true", data

    def drop(self):
        with self.lock:
            if self.conn:
                self.conn.close()
            self.conn = None

    def cut(self):
        """Ends the exchange under way at once (another thread may be in recv)."""
        with self.lock:
            sock = self.conn.sock if self.conn else None
        if sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def label(status, replayed, data):
        out = str(status) + (" replay" if replayed else "")
        if status != 201:
            kind = problem_type(data[:4096])
            if kind:
                out += " " + kind
        return out

    def run(self):
        i = 0
        while not self.stop_flag.is_set():
            i += 1
            key = f"{self.tag}-{i}"
            self.keys.append(key)
            err, status, replayed, data = self.post(key)
            first = None
            if err:
                self.outcomes["new: " + err] += 1
            elif status == 201 and not replayed:
                whole = len(data) == BIG and data.startswith(json.dumps({"key": key})[:-1].encode())
                self.outcomes["new: 201" + ("" if whole else f" WRONG BODY ({len(data)} bytes)")] += 1
                if whole:
                    first = hashlib.sha256(data).digest()
            else:
                self.outcomes["new: " + self.label(status, replayed, data)] += 1
            del data
            if self.stop_flag.is_set():
                break
            t0 = time.monotonic()
            err, status, replayed, data = self.post(key)
            if err:
                self.outcomes["retry: " + err] += 1
            elif status == 201 and replayed and first is not None:
                same = len(data) == BIG and hashlib.sha256(data).digest() == first
                self.outcomes["retry: 201 replay, " + ("identical" if same else f"DIFFERENT ({len(data)} bytes)")] += 1
                if same:
                    self.replay_s.append(time.monotonic() - t0)
            else:
                self.outcomes["retry: " + self.label(status, replayed, data)
                              + ("" if first is not None else " (first not a whole 201)")] += 1


def scenario_i(clients=20, delay_ms=10, warmup=2.0):
    """Large records through a slow store: 20 clients, each a new key's 8 MiB
    answer then its retry, over and over, Redis 10 ms away each way."""
    def build(proxy, tag):
        stop_flag = threading.Event()
        bigs = [BigClient(proxy.port, f"{tag}-big-{i}", stop_flag) for i in range(clients)]
        gauge = {"peak": 0, "samples": []}
        t0 = time.monotonic()

        def sample():
            while not stop_flag.is_set():
                g = proxy.gauge()
                if g is not None:
                    gauge["peak"] = max(gauge["peak"], g)
                    gauge["samples"].append((round(time.monotonic() - t0, 1), g))
                stop_flag.wait(0.1)
        sampler = threading.Thread(target=sample, daemon=True)
        for b in bigs:
            b.start()
        sampler.start()
        time.sleep(warmup)  # the attack is under way before the legitimate clients start

        def stop():
            attack_s = time.monotonic() - t0
            stop_flag.set()
            for b in bigs:
                b.cut()
            for b in bigs:
                b.join(timeout=10)
            sampler.join(timeout=5)
            outcomes = collections.Counter()
            for b in bigs:
                outcomes.update(b.outcomes)
            replay_s = sorted(s for b in bigs for s in b.replay_s)
            retries = sum(v for k, v in outcomes.items() if k.startswith("retry: "))
            identical = sum(v for k, v in outcomes.items() if k.startswith("retry: 201 replay, identical"))
            return {"big_clients_still_running": sum(b.is_alive() for b in bigs),
                    "big_attack_s": round(attack_s, 2),
                    "big_outcomes": dict(outcomes),
                    "big_keys": sum(len(b.keys) for b in bigs),
                    "big_retries": retries,
                    "big_retries_replayed_identical": identical,
                    "big_replay_s": {"n": len(replay_s),
                                     "median": round(replay_s[len(replay_s) // 2], 3) if replay_s else None,
                                     "max": round(replay_s[-1], 3) if replay_s else None},
                    "gauge_peak_during_attack": gauge["peak"],
                    "gauge_series": gauge["samples"][::5]}
        return [], {"attack": f"{clients} clients: protected POST /v1/big (8 MiB answers), a new key then its retry, "
                              f"in a loop; store {delay_ms} ms away each way (relay)", "stop": stop}
    build.relay_delay_ms = delay_ms
    return build


# ---------------------------------------------------------------------------

def mib(kib):
    return f"{kib / 1024:.1f}" if kib else "-"


def legit_line(outcomes):
    return ", ".join(f"{k} ×{v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])) or "nothing"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="abpcdefghi",
                    help="which scenarios, e.g. 'ac' (p: (b) paced; e, f, g: HTTP/2; h: HTTP/1.1 hang-ups; "
                         "i: large records, slow store)")
    ap.add_argument("--idle", type=int, default=10000, help="connections in (c)")
    ap.add_argument("--mixed-idle", type=int, default=2000, help="idle connections in (d)")
    ap.add_argument("--no-build", action="store_true", help="use target/release/idemproxy as it is")
    ap.add_argument("--bin", help="run this idemproxy binary (implies --no-build), e.g. another commit's build")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-relay", help=argparse.SUPPRESS)
    ap.add_argument("--big-clients", type=int, default=20, help="(i): clients sending 8 MiB requests")
    ap.add_argument("--relay-ms", type=int, default=10,
                    help="(i): delay the relay adds to each chunk, each way, ms (0: relayed at once)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "hostile.json"))
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    if args.serve_relay:
        serve_relay(args.serve_relay)
        return

    # Room for the attack's sockets; the proxy (a child) inherits the limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.idle + 3000
    if hard != resource.RLIM_INFINITY and hard < want:
        want = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    idle_n = min(args.idle, want - 1500)
    if idle_n < args.idle:
        print(f"RLIMIT_NOFILE hard limit {hard}: (c) uses {idle_n} connections, not {args.idle}", file=sys.stderr)

    for tool in ("redis-server", "cargo"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}")
    if not args.no_build and not args.bin:
        subprocess.run(["cargo", "build", "--release", "--bin", "idemproxy"], cwd=ROOT, check=True)
    idem_bin = args.bin or os.path.join(ROOT, "target", "release", "idemproxy")

    workdir = tempfile.mkdtemp(prefix="idemproxy-hostile-")
    ctx = {"workdir": workdir, "idem_bin": idem_bin, "upstream_port": free_port(), "redis_port": free_port()}
    helpers = [
        subprocess.Popen(["redis-server", "--port", str(ctx["redis_port"]), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-upstream", str(ctx["upstream_port"])]),
    ]
    scenarios = {
        "a": ("(a) 500 stalled 1 MiB uploads", scenario_a()),
        "b": ("(b) 200 non-readers of an 8 MiB replay", scenario_b()),
        "p": ("(b') as (b), 10 retries every 200 ms", scenario_b_paced()),
        "c": (f"(c) {idle_n:,} idle keep-alive connections", scenario_c(idle_n)),
        "d": (f"(d) mixed: (a) + (b) + {args.mixed_idle:,} idle", scenario_d(idle=args.mixed_idle)),
        "e": ("(e) HTTP/2: 100 conns × 200 streams, no reads", scenario_e()),
        "f": ("(f) HTTP/2: streams reset once under way", scenario_f()),
        "g": ("(g) HTTP/2: windows kept shut, pings", scenario_g()),
        "h": ("(h) HTTP/1.1: hang-ups once under way", scenario_h()),
        "i": (f"(i) {args.big_clients} × 8 MiB records, store {args.relay_ms} ms away",
              scenario_i(clients=args.big_clients, delay_ms=args.relay_ms)),
    }
    results = {}
    started = time.time()
    try:
        wait_port(ctx["redis_port"])
        wait_port(ctx["upstream_port"])
        for name in args.only:
            label, build = scenarios[name]
            results[name] = run_scenario(name, label, ctx, build)
    finally:
        for p in helpers:
            p.terminate()
        for p in helpers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if os.environ.get("HOSTILE_KEEP"):
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    target_rss = {"a": MAX_BUFFERED + 32 * MIB, "b": MAX_BUFFERED + 32 * MIB, "p": MAX_BUFFERED + 32 * MIB, "c": 128 * MIB,
                  "d": MAX_BUFFERED + 32 * MIB, "e": MAX_BUFFERED + 32 * MIB, "f": MAX_BUFFERED + 32 * MIB,
                  "g": MAX_BUFFERED + 32 * MIB, "h": MAX_BUFFERED + 32 * MIB, "i": MAX_BUFFERED + 32 * MIB}
    print()
    print(f"{'scenario':44} {'peak RSS MiB':>12} {'VmHWM':>7} {'target':>8} {'met':>4}  {'crash':>5} {'2nd exec':>8} "
          f"{'recovery s':>10} {'target':>6} {'met':>4}")
    for name, r in results.items():
        tgt = target_rss[name] // 1024
        peak = max(r["peak_rss_kib"], r["vmhwm_kib"] or 0)
        rec = r["recovery"]["full_service_s"]
        r["targets"] = {"rss_kib": tgt, "rss_met": peak <= tgt, "recovery_s": 1.0,
                        "recovery_met": rec is not None and rec < 1.0,
                        "no_crash_met": not r["crashed"], "no_second_execution_met": not r["keys_executed_twice"]}
        print(f"{r['label']:44} {mib(r['peak_rss_kib']):>12} {mib(r['vmhwm_kib']):>7} {'≤ ' + mib(tgt):>8} "
              f"{'yes' if r['targets']['rss_met'] else 'NO':>4}  {'YES' if r['crashed'] else 'no':>5} "
              f"{len(r['keys_executed_twice']):>8} {('%.3f' % rec) if rec is not None else 'never':>10} "
              f"{'< 1':>6} {'yes' if r['targets']['recovery_met'] else 'NO':>4}")
    print()
    for name, r in results.items():
        print(f"{r['label']}:")
        print(f"  attack connections: {r['attack_connections']}")
        print(f"  budget gauge under attack: {r['gauge_under_attack']} bytes; idle RSS {mib(r['idle_rss_kib'])} MiB")
        print(f"  legit, keep-alive from before the attack: {legit_line(r['legit_keepalive_before_attack'])}")
        print(f"  legit, connecting during the attack:      {legit_line(r['legit_connects_during_attack'])}")
        print(f"  wrong answers {r['legit_wrong_answers']}; keys executed {r['keys_executed']}, twice "
              f"{len(r['keys_executed_twice'])}; recovery {r['recovery']}")
        print(f"  proxy log: {r['log_warn']} WARN, {r['log_error']} ERROR, {r['panics']} panics; "
              f"exit after SIGTERM {r['exit_code_after_sigterm']}")
        slow = r.get("upstream_slow_exchanges", {})
        if slow.get("peak"):
            print(f"  upstream exchanges on the slow route: at most {slow['peak']} at once "
                  f"(places per protocol: {MAX_CONNECTIONS})")
        if "big_outcomes" in r:
            print(f"  store through the relay: {r['store_relay_delay_ms']} ms each way, PING "
                  f"{r['store_ping_ms_through_relay']} ms; budget gauge at most {r['gauge_peak_during_attack']} bytes")
            print(f"  8 MiB clients ({r['big_attack_s']} s, {r['big_keys']} keys): {legit_line(r['big_outcomes'])}")
            print(f"  retries replayed byte for byte: {r['big_retries_replayed_identical']} of {r['big_retries']}; "
                  f"replay time {r['big_replay_s']}")
        if "closed_by_proxy_after_build_s" in r:
            print(f"  attack connections closed by the proxy: {r['closed_by_proxy_after_build_s']}")
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "nproc": os.cpu_count(), "commit": head.stdout.strip(),
            "binary": idem_bin,
            "rlimit_nofile": [want, hard], "duration_s": round(time.time() - started, 1),
            "max_buffered": MAX_BUFFERED, "relay_ms": args.relay_ms, "big_clients": args.big_clients, "legit_seconds": LEGIT_SECONDS, "legit_timeout_s": LEGIT_TIMEOUT}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "scenarios": results}, f, indent=1)
    print(f"\nwritten {args.out} ({meta['duration_s']} s)")


if __name__ == "__main__":
    main()
