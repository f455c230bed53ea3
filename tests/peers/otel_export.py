"""Exports two spans with the OpenTelemetry Python SDK's own OTLP exporter.

Used by tests/telemetry.rs to check the harness: what tests/peers/otlp_receiver.py
writes must be what an OpenTelemetry SDK sent it.

    python otel_export.py ENDPOINT [--protocol grpc|http/protobuf]

ENDPOINT is http://127.0.0.1:PORT. Sends a SERVER span `POST /v1/payments`
(attributes of each type, a link, an ERROR status) with a CLIENT child `POST`,
under a resource with service.name "otel-export-check" and
deployment.environment "test", through `opentelemetry-exporter-otlp-proto-grpc`
(or `-proto-http`, to ENDPOINT/v1/traces). Prints one JSON object: trace_id,
server_span_id, client_span_id, link_trace_id, link_span_id (hex).
"""

import argparse
import json
import sys

try:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags
except ImportError as e:
    sys.stderr.write(f"{e}: opentelemetry-sdk is needed ({sys.executable})\n")
    sys.exit(3)


def exporter(endpoint, protocol):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("endpoint")
    p.add_argument("--protocol", choices=["grpc", "http/protobuf"], default="grpc")
    args = p.parse_args()
    try:
        exp = exporter(args.endpoint, args.protocol)
    except ImportError as e:
        sys.stderr.write(
            f"{e}: opentelemetry-exporter-otlp-proto-grpc / -http are needed "
            f"({sys.executable}); tests/run.sh installs them into target/peers-venv\n"
        )
        sys.exit(3)
    resource = Resource.create(
        {"service.name": "otel-export-check", "deployment.environment": "test"}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracer = provider.get_tracer("idemproxy-tests")
    linked = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    with tracer.start_as_current_span(
        "POST /v1/payments",
        kind=trace.SpanKind.SERVER,
        attributes={
            "http.request.method": "POST",
            "http.response.status_code": 201,
            "idempotency.replayed": False,
            "sample.ratio": 0.5,
            "list.of.strings": ["a", "b"],
        },
        links=[Link(linked, {"link.kind": "original"})],
    ) as server:
        with tracer.start_as_current_span("POST", kind=trace.SpanKind.CLIENT) as client:
            client_id = client.get_span_context().span_id
        server.set_status(Status(StatusCode.ERROR, "upstream said no"))
        ctx = server.get_span_context()
    provider.shutdown()
    print(
        json.dumps(
            {
                "trace_id": format(ctx.trace_id, "032x"),
                "server_span_id": format(ctx.span_id, "016x"),
                "client_span_id": format(client_id, "016x"),
                "link_trace_id": format(linked.trace_id, "032x"),
                "link_span_id": format(linked.span_id, "016x"),
            }
        )
    )


if __name__ == "__main__":
    main()
