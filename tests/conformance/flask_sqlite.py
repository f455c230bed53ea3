"""An orders API with Idempotency-Key support, written the way the common
tutorials write it: Flask and SQLite, where a table with a UNIQUE constraint
on the key is the lock. tests/conformance.rs runs `idemproxy conformance`
against it, and against its broken variants.

Usage: flask_sqlite.py PORT [--defect replay-200|no-409|no-fingerprint|race-500]
                            [--delay-ms N] [--db FILE]

The recipe: INSERT the key as 'processing' with a fingerprint of the request;
the UNIQUE constraint makes a second INSERT of the key fail (IntegrityError),
and then the row says what to answer: still processing -> 409, another
request under the key -> 422, done -> the stored status and body. The key is
scoped to the caller (the Authorization header): UNIQUE (principal, key).

The defects, one at a time, as they appear in real code:
  replay-200      the replay is returned with 200 instead of the stored status;
  no-409          no 'processing' row and no unique constraint: the key is
                  looked up, the order created, and the key saved afterwards,
                  so a duplicate that arrives meanwhile runs again;
  no-fingerprint  no fingerprint: a key sent again with another body gets the
                  first request's answer;
  race-500        the key is looked up, the order created, and only then the
                  key inserted: a duplicate that arrived meanwhile has run
                  too, and its INSERT fails on the UNIQUE constraint, which it
                  answers with a 500 (one stored answer, every request run).

GET /__executions answers {"executions": N}, the orders created so far.
"""

import argparse
import hashlib
import json
import os
import sqlite3
import tempfile
import time

from flask import Flask, Response, g, jsonify, request

app = Flask(__name__)
ARGS = None

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    amount INTEGER,
    payload TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    principal TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,            -- 'processing' or 'done'
    response_code INTEGER,
    response_headers TEXT,
    response_body TEXT,
    created_at REAL NOT NULL,
    UNIQUE (principal, key)          -- the lock
);
"""

# The no-409 variant as such code is often written: a plain table, no constraint.
SCHEMA_NO_LOCK = SCHEMA.replace(",\n    UNIQUE (principal, key)          -- the lock", "")


def get_db():
    if "db" not in g:
        g.db = sqlite3.connect(ARGS.db, timeout=30)
        g.db.row_factory = sqlite3.Row
    return g.db


@app.teardown_appcontext
def close_db(_exc):
    db = g.pop("db", None)
    if db is not None:
        db.close()


def problem(status, kind, title, detail, headers=None):
    """An RFC 9457 problem document."""
    body = json.dumps({"type": kind, "title": title, "status": status, "detail": detail})
    return Response(body, status=status, headers=headers or {},
                    content_type="application/problem+json")


def fingerprint():
    h = hashlib.sha256()
    h.update(request.method.encode())
    h.update(request.path.encode())
    h.update(request.get_data())
    return h.hexdigest()


def replay(row):
    status = 200 if ARGS.defect == "replay-200" else row["response_code"]
    headers = json.loads(row["response_headers"])
    headers["Idempotent-Replayed"] = "true"
    return Response(row["response_body"], status=status, headers=headers,
                    content_type="application/json")


def create_order():
    """The operation the key protects: slow, as real work (a payment provider) is."""
    time.sleep(ARGS.delay_ms / 1000)
    data = request.get_json(silent=True) or {}
    db = get_db()
    with db:
        cur = db.execute("INSERT INTO orders (amount, payload) VALUES (?, ?)",
                         (data.get("amount"), request.get_data(as_text=True)))
    order = {"id": "ord_%d" % cur.lastrowid, "amount": data.get("amount"), "status": "created"}
    return 201, {"Location": "/orders/%s" % order["id"]}, json.dumps(order)


@app.post("/orders")
def orders():
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return problem(400, "idempotency-key-missing", "Idempotency-Key is missing",
                       "This operation requires an Idempotency-Key header.")
    if key == "" or len(key) > 255:
        return problem(400, "idempotency-key-invalid", "Idempotency-Key is invalid",
                       "A key has 1 to 255 characters.")
    principal = request.headers.get("Authorization", "")
    if ARGS.defect == "no-409":
        return orders_without_lock(principal, key)
    if ARGS.defect == "race-500":
        return orders_insert_after(principal, key)
    fp = "" if ARGS.defect == "no-fingerprint" else fingerprint()
    db = get_db()
    try:
        with db:
            db.execute(
                "INSERT INTO idempotency_keys (principal, key, fingerprint, status, created_at)"
                " VALUES (?, ?, ?, 'processing', ?)", (principal, key, fp, time.time()))
    except sqlite3.IntegrityError:
        row = db.execute("SELECT * FROM idempotency_keys WHERE principal = ? AND key = ?",
                         (principal, key)).fetchone()
        if row["fingerprint"] != fp:
            return problem(422, "idempotency-key-reused", "Idempotency-Key is already used",
                           "This key was used with another request; use a new key.")
        if row["status"] == "processing":
            return problem(409, "request-in-progress", "A request is outstanding for this key",
                           "The first request with this key is still being processed.",
                           headers={"Retry-After": "1"})
        return replay(row)
    try:
        status, headers, body = create_order()
    except Exception:
        with db:  # let a retry run again
            db.execute("DELETE FROM idempotency_keys WHERE principal = ? AND key = ?",
                       (principal, key))
        raise
    with db:
        db.execute(
            "UPDATE idempotency_keys SET status = 'done', response_code = ?,"
            " response_headers = ?, response_body = ? WHERE principal = ? AND key = ?",
            (status, json.dumps(headers), body, principal, key))
    return Response(body, status=status, headers=headers, content_type="application/json")


def orders_without_lock(principal, key):
    """The defect no-409: look the key up, do the work, save the key afterwards."""
    fp = fingerprint()
    db = get_db()
    row = db.execute("SELECT * FROM idempotency_keys WHERE principal = ? AND key = ?",
                     (principal, key)).fetchone()
    if row is not None:
        if row["fingerprint"] != fp:
            return problem(422, "idempotency-key-reused", "Idempotency-Key is already used",
                           "This key was used with another request; use a new key.")
        return replay(row)
    status, headers, body = create_order()
    with db:
        db.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, response_code,"
            " response_headers, response_body, created_at) VALUES (?, ?, ?, 'done', ?, ?, ?, ?)",
            (principal, key, fp, status, json.dumps(headers), body, time.time()))
    return Response(body, status=status, headers=headers, content_type="application/json")


def orders_insert_after(principal, key):
    """The defect race-500: look the key up, do the work, then INSERT the key,
    the UNIQUE constraint refusing all but one of simultaneous duplicates."""
    fp = fingerprint()
    db = get_db()
    row = db.execute("SELECT * FROM idempotency_keys WHERE principal = ? AND key = ?",
                     (principal, key)).fetchone()
    if row is not None:
        if row["fingerprint"] != fp:
            return problem(422, "idempotency-key-reused", "Idempotency-Key is already used",
                           "This key was used with another request; use a new key.")
        return replay(row)
    status, headers, body = create_order()
    try:
        with db:
            db.execute(
                "INSERT INTO idempotency_keys (principal, key, fingerprint, status,"
                " response_code, response_headers, response_body, created_at)"
                " VALUES (?, ?, ?, 'done', ?, ?, ?, ?)",
                (principal, key, fp, status, json.dumps(headers), body, time.time()))
    except sqlite3.IntegrityError as e:
        return problem(500, "internal-error", "Internal Server Error", str(e))
    return Response(body, status=status, headers=headers, content_type="application/json")


@app.get("/__executions")
def executions():
    (n,) = get_db().execute("SELECT COUNT(*) FROM orders").fetchone()
    return jsonify(executions=n)


@app.get("/health")
def health():
    return jsonify(ok=True)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--defect", choices=["replay-200", "no-409", "no-fingerprint", "race-500"])
    parser.add_argument("--delay-ms", type=int, default=300)
    parser.add_argument("--db")
    ARGS = parser.parse_args()
    if ARGS.db is None:
        ARGS.db = os.path.join(tempfile.mkdtemp(prefix="flask-sqlite-"), "orders.db")
    db = sqlite3.connect(ARGS.db)
    db.executescript(SCHEMA_NO_LOCK if ARGS.defect == "no-409" else SCHEMA)
    db.close()
    app.run(host="127.0.0.1", port=ARGS.port, threaded=True)


if __name__ == "__main__":
    main()
