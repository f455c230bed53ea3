"""A real OTLP trace receiver: what an OpenTelemetry collector answers on.

Used by tests/telemetry.rs (through tests/support/otel.rs) to see the spans
the proxy exports. The gRPC side is the generated `TraceService` servicer of
the `opentelemetry-proto` package served by `grpcio`; the HTTP side (flag
`--protocol http/protobuf`) is OTLP/HTTP with protobuf bodies, on `http.server`.

    python otlp_receiver.py [--port N] [--protocol grpc|http/protobuf] [--out FILE]

Listens on 127.0.0.1:N (0, the default: a free port) and prints one JSON
line first, `{"listening": PORT, "protocol": ...}`; then one JSON line per
span received, to stdout (or appended to FILE):

    trace_id, span_id, parent_span_id (hex; "" for a root), name,
    kind ("SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER", "UNSPECIFIED"),
    attributes (a flat object), links [{trace_id, span_id, attributes}],
    resource (the resource's attributes), scope (instrumentation scope name),
    status {code: "UNSET" | "OK" | "ERROR", message}, trace_state, flags,
    start_time_unix_nano, end_time_unix_nano, and export_path (the HTTP
    request's path; for gRPC the method).

Every export is answered with success. Runs until killed.
"""

import argparse
import gzip
import json
import sys
import threading
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )
    from opentelemetry.proto.trace.v1 import trace_pb2
except ImportError as e:
    sys.stderr.write(
        f"{e}: grpcio and opentelemetry-proto are needed ({sys.executable}); "
        "tests/run.sh installs them into target/peers-venv\n"
    )
    sys.exit(3)

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

_out_lock = threading.Lock()
_out = sys.stdout


def emit(obj):
    line = json.dumps(obj, sort_keys=True)
    with _out_lock:
        _out.write(line + "\n")
        _out.flush()


def any_value(v):
    """An OTLP AnyValue as plain JSON."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "string_value":
        return v.string_value
    if which == "bool_value":
        return v.bool_value
    if which == "int_value":
        return v.int_value
    if which == "double_value":
        return v.double_value
    if which == "bytes_value":
        return v.bytes_value.hex()
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return None


def attributes(kvs):
    return {kv.key: any_value(kv.value) for kv in kvs}


def kind_name(kind):
    name = trace_pb2.Span.SpanKind.Name(kind)
    return name.removeprefix("SPAN_KIND_")


def status(s):
    code = trace_pb2.Status.StatusCode.Name(s.code).removeprefix("STATUS_CODE_")
    return {"code": code, "message": s.message}


def record(request, export_path, headers):
    """Writes each span of an ExportTraceServiceRequest as one line, with the
    headers (gRPC metadata) its export came with, names lowercased."""
    n = 0
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                emit(
                    {
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": kind_name(span.kind),
                        "attributes": attributes(span.attributes),
                        "links": [
                            {
                                "trace_id": link.trace_id.hex(),
                                "span_id": link.span_id.hex(),
                                "trace_state": link.trace_state,
                                "flags": link.flags,
                                "attributes": attributes(link.attributes),
                            }
                            for link in span.links
                        ],
                        "resource": resource,
                        "scope": ss.scope.name,
                        "status": status(span.status),
                        "trace_state": span.trace_state,
                        "flags": span.flags,
                        "start_time_unix_nano": span.start_time_unix_nano,
                        "end_time_unix_nano": span.end_time_unix_nano,
                        "export_path": export_path,
                        "export_headers": headers,
                    }
                )
                n += 1
    return n


# --reject-every N: every Nth span received is answered as rejected (a
# partial success naming how many, "quota exceeded"); the spans are still
# written, so that a test can count what was rejected.
_reject_every = 0


def response_for(n):
    """The ExportTraceServiceResponse for an export of n spans."""
    response = trace_service_pb2.ExportTraceServiceResponse()
    if _reject_every:
        rejected = n // _reject_every
        if rejected:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = "quota exceeded"
    return response


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        metadata = {k.lower(): v for k, v in context.invocation_metadata() if isinstance(v, str)}
        n = record(request, GRPC_METHOD, metadata)
        return response_for(n)


def serve_grpc(port):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        sys.stderr.write(f"cannot bind 127.0.0.1:{port}\n")
        sys.exit(2)
    server.start()
    return bound, server.wait_for_termination


class OtlpHttp(BaseHTTPRequestHandler):
    """OTLP/HTTP, binary protobuf: POST an ExportTraceServiceRequest."""

    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: stdout carries the spans
        pass

    def answer(self, code, body, content_type):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_POST(self):
        body = self.read_body()
        encoding = (self.headers.get("Content-Encoding") or "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype != "application/x-protobuf":
            sys.stderr.write(f"POST {self.path}: content-type {ctype!r} refused\n")
            self.answer(415, b"application/x-protobuf only", "text/plain")
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as e:  # a body that is not the message
            sys.stderr.write(f"POST {self.path}: {e}\n")
            self.answer(400, str(e).encode(), "text/plain")
            return
        n = record(request, self.path, {k.lower(): v for k, v in self.headers.items()})
        response = response_for(n)
        self.answer(200, response.SerializeToString(), "application/x-protobuf")


def serve_http(port):
    server = ThreadingHTTPServer(("127.0.0.1", port), OtlpHttp)
    server.daemon_threads = True
    return server.server_address[1], server.serve_forever


def main():
    global _out
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--protocol", choices=["grpc", "http/protobuf"], default="grpc")
    p.add_argument("--out", help="append span lines to this file, not stdout")
    p.add_argument("--reject-every", type=int, default=0,
                   help="answer a partial success rejecting one span in N")
    args = p.parse_args()
    global _reject_every
    _reject_every = args.reject_every
    if args.out:
        _out = open(args.out, "a", buffering=1)
    if args.protocol == "grpc":
        port, run = serve_grpc(args.port)
    else:
        port, run = serve_http(args.port)
    # The listening line goes to stdout whatever --out says: the test reads it.
    sys.stdout.write(json.dumps({"listening": port, "protocol": args.protocol}) + "\n")
    sys.stdout.flush()
    run()


if __name__ == "__main__":
    main()
