"""One POST made by urllib3 with its `Retry`, a real client that obeys Retry-After.

Used by tests/protected.rs (a 409's Retry-After estimate):

    python urllib3_retry.py URL KEY BODY

Retries a 409 up to 5 times, waiting what `Retry-After` says (and nothing
more: no backoff of its own). Prints one JSON object: `status`, `replayed`
(the Idempotent-Replayed header), `body`, `retries` (how many it made) and
`elapsed` in seconds.
"""

import json
import sys
import time

try:
    import urllib3
    from urllib3.util.retry import Retry
except ImportError:
    sys.stderr.write(
        f"urllib3 is not installed for {sys.executable}; tests/run.sh installs it "
        "(target/peers-venv), or: python3 -m venv target/peers-venv && "
        "target/peers-venv/bin/pip install grpcio urllib3\n"
    )
    sys.exit(3)


def main():
    url, key, body = sys.argv[1:4]
    retry = Retry(
        total=5,
        status_forcelist=[409],
        allowed_methods=None,  # POST too: the key makes it safe to retry
        respect_retry_after_header=True,
        backoff_factor=0,
        raise_on_status=False,
    )
    http = urllib3.PoolManager(retries=retry)
    started = time.monotonic()
    r = http.request("POST", url, body=body.encode(), headers={"Idempotency-Key": key})
    print(
        json.dumps(
            {
                "status": r.status,
                "replayed": r.headers.get("Idempotent-Replayed"),
                "body": r.data.decode(errors="replace"),
                "retries": len(r.retries.history) if r.retries else 0,
                "elapsed": time.monotonic() - started,
            }
        )
    )


main()
