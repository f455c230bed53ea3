#!/usr/bin/env python3
"""User-space instructions per request, under valgrind's callgrind.

The same binary and inputs give the same count whatever else the machine is
doing (to about 1 %: timers and the date cache tick on their own), so two
builds can be compared where CPU time is too noisy. One Python client on one
keep-alive connection sends 300 requests of warm-up; then
`callgrind_control -z` zeroes the counts, N requests (default 1,000, env N)
are counted and dumped. SHA-256 runs in software under valgrind (no SHA-NI),
so it weighs more here than on the machine.

    bench/callgrind.py idem BINARY [replay|newkey|pt]
        an idemproxy (RUST_LOG=warn, one worker, its own Redis and a small
        Python upstream): replays of one stored key, new keys, or
        pass-through GETs
    bench/callgrind.py floor examples/hyper_floor [memory|redis:PORT|raw:PORT|wire:PORT|proxy:UPSTREAM|replay:PORT]
        the floor server of bench/floor.py (PORT is replaced by its Redis's
        port, UPSTREAM by the Python upstream's); replay:PORT is sent the
        replays of one key that `idem ... replay` is sent

Prints the instructions per request and the dump's path, for
callgrind_annotate (e.g. --inclusive=yes).
"""
import http.client, os, socket, subprocess, sys, tempfile, time, threading, glob
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def wait(port, t=60):
    end = time.time() + t
    while time.time() < end:
        try: socket.create_connection(("127.0.0.1", port), 0.2).close(); return
        except OSError: time.sleep(0.1)
    raise SystemExit(f"port {port} never opened")

class Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_any(self):
        n = int(self.headers.get("content-length") or 0); self.rfile.read(n)
        b = b'{"id":"pay_1","status":"succeeded","amount":4200}'
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    do_GET = do_POST = do_any
    def log_message(self, *a): pass

def main():
    kind, binp = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else "replay"
    n = int(os.environ.get("N", "1000"))
    d = tempfile.mkdtemp(prefix="cg-")
    rp = free()
    redis = subprocess.Popen(["redis-server", "--port", str(rp), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    wait(rp)
    port = free()
    out = os.path.join(d, "callgrind.out")
    vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    up = ThreadingHTTPServer(("127.0.0.1", 0), Up); threading.Thread(target=up.serve_forever, daemon=True).start()
    if kind == "idem":
        cfg = os.path.join(d, "c.toml")
        open(cfg, "w").write(f'''[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{free()}"
upstream = "http://127.0.0.1:{up.server_address[1]}"
workers = 1
[store]
backend = "redis"
url = "redis://127.0.0.1:{rp}/0"
[[routes]]
name = "payments"
path = "/v1/payments"
''')
        proc = subprocess.Popen(vg + [binp, "--config", cfg], env=dict(os.environ, RUST_LOG="warn"), stderr=open(os.path.join(d, "err"), "w"))
    else:
        proc = subprocess.Popen(vg + [binp, f"127.0.0.1:{port}", arg.replace("PORT", str(rp)).replace("UPSTREAM", str(up.server_address[1]))], stderr=open(os.path.join(d, "err"), "w"))
    wait(port, 120)
    c = http.client.HTTPConnection("127.0.0.1", port)
    i = [0]
    def one():
        i[0] += 1
        if arg == "pt" or (kind == "floor" and not arg.startswith("replay")):
            c.request("GET", "/x")
        else:
            key = "k-1" if arg.startswith("replay") else f"k-{i[0]}"
            c.request("POST", "/v1/payments", body='{"amount":4200}',
                      headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        r = c.getresponse(); r.read(); assert r.status < 300, r.status
    for _ in range(300): one()
    subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)
    for _ in range(n): one()
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)
    time.sleep(1)
    proc.terminate(); proc.wait(); redis.terminate()
    files = sorted(glob.glob(out + "*"), key=os.path.getmtime)
    f = [x for x in files if os.path.getsize(x) > 0 and x != out] or files
    dump = f[0]
    tot = subprocess.run(["callgrind_annotate", dump], capture_output=True, text=True).stdout
    for line in tot.splitlines():
        if "PROGRAM TOTALS" in line:
            v = int(line.split()[0].replace(",", ""))
            print(f"{kind} {arg}: {v / n:.0f} instructions/request  ({dump})")
            break

main()
