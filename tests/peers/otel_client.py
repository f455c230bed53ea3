"""One HTTP request made inside a span of the OpenTelemetry Python SDK.

Used by tests/telemetry.rs: a real instrumented client whose W3C context the
proxy must continue. The SDK starts a CLIENT span; its propagator
(`opentelemetry.propagate.inject`, W3C Trace Context by default) writes
`traceparent` into the request's headers; http.client sends it.

    python otel_client.py URL [--method POST] [--key KEY] [--body TEXT]
                          [--header 'Name: value']... [--unsampled] [--no-span]

--unsampled: the span is not sampled (the SDK's ALWAYS_OFF sampler): the
             request carries a valid context with the sampled flag unset.
--no-span:   no span and no traceparent (a root request).

Prints one JSON object: trace_id, span_id (hex; "" with --no-span), sampled,
traceparent (as sent, or null), status, headers (lower-case names; repeated
ones joined with ", "), body (text).
"""

import argparse
import http.client
import json
import sys
import urllib.parse

try:
    from opentelemetry import propagate, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
except ImportError as e:
    sys.stderr.write(
        f"{e}: opentelemetry-sdk is needed ({sys.executable}); "
        "tests/run.sh installs it into target/peers-venv\n"
    )
    sys.exit(3)


def send(url, method, headers, body):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    target = u.path + (f"?{u.query}" if u.query else "")
    conn.request(method, target, body=body, headers=headers)
    resp = conn.getresponse()
    out_headers = {}
    for name, value in resp.getheaders():
        name = name.lower()
        out_headers[name] = f"{out_headers[name]}, {value}" if name in out_headers else value
    data = resp.read()
    conn.close()
    return resp.status, out_headers, data.decode("utf-8", "replace")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--method", default="POST")
    p.add_argument("--key")
    p.add_argument("--body", default="")
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--unsampled", action="store_true")
    p.add_argument("--no-span", action="store_true")
    args = p.parse_args()

    headers = {}
    for h in args.header:
        name, _, value = h.partition(":")
        headers[name.strip()] = value.strip()
    if args.key is not None:
        headers["Idempotency-Key"] = args.key
    body = args.body.encode()

    out = {"trace_id": "", "span_id": "", "sampled": False, "traceparent": None}
    if args.no_span:
        status, resp_headers, resp_body = send(args.url, args.method, headers, body)
    else:
        provider = TracerProvider(sampler=ALWAYS_OFF if args.unsampled else ALWAYS_ON)
        tracer = provider.get_tracer("idemproxy-tests")
        with tracer.start_as_current_span(
            f"{args.method} client", kind=trace.SpanKind.CLIENT
        ) as span:
            ctx = span.get_span_context()
            carrier = {}
            propagate.inject(carrier)
            headers.update(carrier)
            out.update(
                trace_id=format(ctx.trace_id, "032x"),
                span_id=format(ctx.span_id, "016x"),
                sampled=ctx.trace_flags.sampled,
                traceparent=carrier.get("traceparent"),
            )
            status, resp_headers, resp_body = send(args.url, args.method, headers, body)
        provider.shutdown()
    out.update(status=status, headers=resp_headers, body=resp_body)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
