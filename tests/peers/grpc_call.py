"""One gRPC unary call made by grpcio, a real client with a retry policy.

Used by tests/grpc.rs: it shows whether grpcio's own retry policy
(`retryPolicy` in the service config) retries the proxy's gRPC errors.

    python grpc_call.py TARGET METHOD REQUEST_HEX KEY MAX_ATTEMPTS

Sends the request bytes (a serialized message, hex) to METHOD at TARGET
(host:port, cleartext HTTP/2) with `idempotency-key: KEY`, retrying ABORTED
and UNAVAILABLE up to MAX_ATTEMPTS attempts in all. Prints one JSON object:
`ok`, then `response_hex` and `metadata` (initial metadata) on success, or
`code` and `details` on failure, and `elapsed` in seconds.
"""

import json
import sys
import time

try:
    import grpc
except ImportError:
    sys.stderr.write(
        f"grpcio is not installed for {sys.executable}; tests/run.sh installs it "
        "(target/peers-venv), or: python3 -m venv target/peers-venv && "
        "target/peers-venv/bin/pip install grpcio urllib3\n"
    )
    sys.exit(3)


def main():
    target, method, request_hex, key, max_attempts = sys.argv[1:6]
    service = method.strip("/").split("/")[0]
    config = {
        "methodConfig": [
            {
                "name": [{"service": service}],
                "retryPolicy": {
                    "maxAttempts": int(max_attempts),
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["ABORTED", "UNAVAILABLE"],
                },
            }
        ]
    }
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(config)),
        ("grpc.enable_http_proxy", 0),
    ]
    started = time.monotonic()
    with grpc.insecure_channel(target, options=options) as channel:
        # No serializers: the request and the response are bytes.
        call = channel.unary_unary(method)
        try:
            response, outcome = call.with_call(
                bytes.fromhex(request_hex),
                metadata=[("idempotency-key", key)],
                timeout=30,
            )
            out = {
                "ok": True,
                "response_hex": response.hex(),
                "metadata": {k: v for k, v in outcome.initial_metadata()},
            }
        except grpc.RpcError as e:
            out = {"ok": False, "code": e.code().name, "details": e.details()}
    out["elapsed"] = time.monotonic() - started
    print(json.dumps(out))


main()
