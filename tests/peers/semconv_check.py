"""Checks the proxy's spans against the OpenTelemetry semantic conventions'
published registry, as the Python package `opentelemetry-semantic-conventions`
ships it: `opentelemetry.semconv.attributes.*` are the stable attributes (with
their `*Values` enums), `opentelemetry.semconv._incubating.attributes.*`
everything registered (development and deprecated too).

Used by tests/telemetry.rs (`every_kind_of_span_follows_the_registered_conventions`).

    python semconv_check.py [FILE ...]     spans as JSON lines (stdin without FILE)
    python semconv_check.py --self-test    good and bad spans built here: the bad
                                           ones must be caught

The lines are those tests/peers/otlp_receiver.py writes (and tests/support/otel.rs
reads as `Span`): name, kind ("SERVER", "CLIENT", "INTERNAL", ...), attributes
(a flat object; an OTLP int is a JSON number, a string a JSON string, a bool
true/false), status {code: "UNSET" | "OK" | "ERROR", message}, ... Its
`{"listening": PORT}` line is skipped.

Attribute names, their stability and enum values come from the package, found
by walking its modules (nothing here lists them). What the package does not
carry, the HTTP span conventions' requirement levels and value types, is in
the tables below, naming each attribute by the package's constant.

The first line printed names the package's version and how many spans were
checked; then every violation, as `span NAME (KIND): ...`. Exit 0 when there
is none, 1 when there are (or when there was no span to check: a check of
nothing proves nothing), 3 when the package is missing.
"""

import argparse
import importlib
import importlib.metadata
import json
import pkgutil
import re
import sys
import urllib.parse
from enum import Enum

try:
    import opentelemetry.semconv._incubating.attributes as incubating_package
    import opentelemetry.semconv.attributes as stable_package
    from opentelemetry.semconv.attributes import (
        client_attributes,
        error_attributes,
        http_attributes,
        network_attributes,
        server_attributes,
        url_attributes,
        user_agent_attributes,
    )
except ImportError as e:
    sys.stderr.write(
        f"{e}: opentelemetry-semantic-conventions is needed ({sys.executable}); "
        "tests/run.sh installs it into target/peers-venv\n"
    )
    sys.exit(3)

PACKAGE = "opentelemetry-semantic-conventions"

# Our own attributes and INTERNAL spans live here; nothing registered may.
OUR_NAMESPACE = "idempotency."

# ---------------------------------------------------------------------------
# What the package does not carry. Requirement levels and value types come
# from the HTTP spans conventions page (the OpenTelemetry semantic
# conventions' "Semantic conventions for HTTP spans": "HTTP client span" and
# "HTTP server span", both Stable; https://opentelemetry.io/docs/specs/semconv/http/http-spans/). Names, stability and enum values come from the package.

HTTP_REQUEST_METHOD = http_attributes.HTTP_REQUEST_METHOD
HTTP_REQUEST_METHOD_ORIGINAL = http_attributes.HTTP_REQUEST_METHOD_ORIGINAL
HTTP_RESPONSE_STATUS_CODE = http_attributes.HTTP_RESPONSE_STATUS_CODE
HTTP_ROUTE = http_attributes.HTTP_ROUTE
ERROR_TYPE = error_attributes.ERROR_TYPE
SERVER_ADDRESS = server_attributes.SERVER_ADDRESS
SERVER_PORT = server_attributes.SERVER_PORT
URL_FULL = url_attributes.URL_FULL

# `Required` on the HTTP server span. (`http.response.status_code` is
# Conditionally Required "if and only if one was sent": the proxy answers
# every request it makes a SERVER span for, so it is always there.)
SERVER_REQUIRED = (
    http_attributes.HTTP_REQUEST_METHOD,
    url_attributes.URL_PATH,
    url_attributes.URL_SCHEME,
    http_attributes.HTTP_RESPONSE_STATUS_CODE,
)

# `Required` on the HTTP client span.
CLIENT_REQUIRED = (
    http_attributes.HTTP_REQUEST_METHOD,
    server_attributes.SERVER_ADDRESS,
    server_attributes.SERVER_PORT,
    url_attributes.URL_FULL,
)

# Value types of the stable attributes the two span tables list ("Value Type").
INT, STRING, STRINGS = "int", "string", "string[]"
VALUE_TYPES = {
    http_attributes.HTTP_REQUEST_METHOD: STRING,
    http_attributes.HTTP_REQUEST_METHOD_ORIGINAL: STRING,
    http_attributes.HTTP_RESPONSE_STATUS_CODE: INT,
    http_attributes.HTTP_REQUEST_RESEND_COUNT: INT,
    http_attributes.HTTP_ROUTE: STRING,
    http_attributes.HTTP_REQUEST_HEADER_TEMPLATE: STRINGS,
    http_attributes.HTTP_RESPONSE_HEADER_TEMPLATE: STRINGS,
    error_attributes.ERROR_TYPE: STRING,
    server_attributes.SERVER_ADDRESS: STRING,
    server_attributes.SERVER_PORT: INT,
    client_attributes.CLIENT_ADDRESS: STRING,
    client_attributes.CLIENT_PORT: INT,
    url_attributes.URL_FULL: STRING,
    url_attributes.URL_PATH: STRING,
    url_attributes.URL_QUERY: STRING,
    url_attributes.URL_SCHEME: STRING,
    network_attributes.NETWORK_PROTOCOL_NAME: STRING,
    network_attributes.NETWORK_PROTOCOL_VERSION: STRING,
    network_attributes.NETWORK_PEER_ADDRESS: STRING,
    network_attributes.NETWORK_PEER_PORT: INT,
    network_attributes.NETWORK_LOCAL_ADDRESS: STRING,
    network_attributes.NETWORK_LOCAL_PORT: INT,
    network_attributes.NETWORK_TRANSPORT: STRING,
    user_agent_attributes.USER_AGENT_ORIGINAL: STRING,
}

# Attributes whose enum only names well-known values: any string will do
# (the registry's `error.type` has `_OTHER` and nothing else). Every other
# enum is closed: its value must be one of the enum's.
OPEN_ENUMS = {error_attributes.ERROR_TYPE}

# Ports, `server.port` and the like.
PORTS = range(1, 65536)


# ---------------------------------------------------------------------------
# The registry, read from the package.


class Registry:
    """What the package registers: names (stable and not), templates, enums."""

    def __init__(self):
        self.version = importlib.metadata.version(PACKAGE)
        # name -> "module.CONSTANT", for messages
        self.stable, self.stable_templates = {}, {}
        self.registered, self.registered_templates = {}, {}
        # stable attribute name -> set of its enum's values
        self.enums = {}
        self._walk(stable_package, stable=True)
        self._walk(incubating_package, stable=False)
        # The stable ones are registered too (the incubating modules repeat
        # them, deprecated in favour of the stable module: count them anyway).
        self.registered.update(self.stable)
        self.registered_templates.update(self.stable_templates)
        if len(self.stable) < 20 or HTTP_REQUEST_METHOD not in self.enums:
            raise SystemExit(
                f"{PACKAGE} {self.version}: found {len(self.stable)} stable attributes and "
                f"enums for {sorted(self.enums)}: has the package's layout changed?"
            )

    def _walk(self, package, stable):
        names = self.stable if stable else self.registered
        templates = self.stable_templates if stable else self.registered_templates
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            short = info.name
            constants = {}
            for attr, value in vars(module).items():
                if re.fullmatch(r"[A-Z][A-Z0-9_]*", attr) and isinstance(value, str):
                    constants[attr] = value
                    where = f"{short}.{attr}"
                    if attr.endswith("_TEMPLATE"):
                        templates[value] = where
                    else:
                        names[value] = where
            if not stable:
                continue
            for attr, value in vars(module).items():
                if not (
                    isinstance(value, type)
                    and issubclass(value, Enum)
                    and value.__module__ == module.__name__
                ):
                    continue
                # HttpRequestMethodValues -> HTTP_REQUEST_METHOD
                constant = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", attr.removesuffix("Values"))
                constant = constant.upper()
                if not attr.endswith("Values") or constant not in constants:
                    raise SystemExit(
                        f"{PACKAGE} {self.version}: the enum {short}.{attr} names no "
                        f"attribute ({constant} is not in {short}): has the layout changed?"
                    )
                self.enums[constants[constant]] = {m.value for m in value}

    @staticmethod
    def _template_of(key, templates):
        for prefix in templates:
            if key.startswith(prefix + "."):
                return prefix
        return None

    def stable_name(self, key):
        """The stable name (or template) `key` is, else None."""
        if key in self.stable:
            return key
        return self._template_of(key, self.stable_templates)

    def is_registered(self, key):
        return key in self.registered or self._template_of(key, self.registered_templates)

    def in_our_namespace(self):
        """Registered names (stable or not) under our namespace: must be none."""
        ns = OUR_NAMESPACE.rstrip(".")
        every = list(self.registered) + list(self.registered_templates)
        return sorted(n for n in every if n == ns or n.startswith(OUR_NAMESPACE))


# ---------------------------------------------------------------------------
# The checks.


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def type_ok(v, want):
    if want == INT:
        return is_int(v)
    if want == STRING:
        return isinstance(v, str)
    if want == STRINGS:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    return True


def check_attributes(attrs, reg, out):
    for key, value in attrs.items():
        if key.startswith(OUR_NAMESPACE):
            if reg.is_registered(key):
                out.append(f"{key} is ours but registered in the conventions")
            if value is None or isinstance(value, (list, dict)):
                out.append(f"{key} = {value!r}: our attributes are scalars")
            continue
        name = reg.stable_name(key)
        if name is None:
            if reg.is_registered(key):
                out.append(
                    f"{key} is registered but not stable in {PACKAGE} {reg.version} "
                    "(incubating: development or deprecated); we promise stable conventions"
                )
            else:
                out.append(
                    f"{key} is neither a registered attribute nor in our namespace "
                    f"{OUR_NAMESPACE}*"
                )
            continue
        want = VALUE_TYPES.get(name)
        if want and not type_ok(value, want):
            out.append(f"{key} = {value!r} ({type(value).__name__}): the conventions say {want}")
            continue
        if name in reg.enums:
            values = reg.enums[name]
            if name in OPEN_ENUMS:
                if not isinstance(value, str) or not value:
                    out.append(f"{key} = {value!r}: a non-empty string")
            elif value not in values:
                out.append(f"{key} = {value!r} is not one of the registry's {sorted(values)}")


def method_rules(attrs, out):
    """`http.request.method_original` iff the method is `_OTHER`; the
    `{method}` of the span name (`HTTP` for `_OTHER`), or None."""
    method = attrs.get(HTTP_REQUEST_METHOD)
    original = attrs.get(HTTP_REQUEST_METHOD_ORIGINAL)
    if not isinstance(method, str):
        return None
    if method == "_OTHER":
        if original is None:
            out.append(
                f"{HTTP_REQUEST_METHOD} is _OTHER and {HTTP_REQUEST_METHOD_ORIGINAL} "
                "(the method sent) is missing"
            )
        elif original == "_OTHER":
            out.append(f"{HTTP_REQUEST_METHOD_ORIGINAL} = '_OTHER': the method sent, not _OTHER")
        return "HTTP"
    if original is not None:
        out.append(
            f"{HTTP_REQUEST_METHOD_ORIGINAL} = {original!r} but {HTTP_REQUEST_METHOD} is "
            f"{method!r}: only when it is _OTHER (it differs from the method sent)"
        )
    return method


def check_port(attrs, out):
    port = attrs.get(SERVER_PORT)
    if port is None:
        return
    if is_int(port) and port not in PORTS:
        out.append(f"{SERVER_PORT} = {port}: not a port (1..65535)")
    if SERVER_ADDRESS not in attrs:
        out.append(f"{SERVER_PORT} without {SERVER_ADDRESS}")


def check_status_by_code(span, code, out, what):
    """Status and `error.type` when a response was sent (SERVER) or received
    (CLIENT): ERROR and `error.type` = the code iff >= 500, else neither."""
    attrs, status = span["attributes"], span["status"]
    error_type = attrs.get(ERROR_TYPE)
    if code >= 500:
        if status["code"] != "ERROR":
            out.append(f"status {status['code']} on a {code}: ERROR ({what} 5xx)")
        if error_type != str(code):
            out.append(f"{ERROR_TYPE} = {error_type!r} on a {code}: the code, {str(code)!r}")
    else:
        if status["code"] != "UNSET":
            out.append(f"status {status['code']} on a {code}: UNSET")
        if error_type is not None:
            out.append(f"{ERROR_TYPE} = {error_type!r} on a {code}: none below 500")
    if status["message"]:
        out.append(
            f"status message {status['message']!r}: none when "
            f"{HTTP_RESPONSE_STATUS_CODE} says it all"
        )


def check_server(span, out):
    attrs = span["attributes"]
    for key in SERVER_REQUIRED:
        if key not in attrs:
            out.append(f"{key} is Required on a SERVER span and missing")
    method = method_rules(attrs, out)
    if method is not None:
        route = attrs.get(HTTP_ROUTE)
        want = f"{method} {route}" if route else method
        if span["name"] != want:
            out.append(f"named {span['name']!r}: the conventions say {want!r}")
    # Conditionally Required "if available and server.address is set": the
    # port of the Host (or :authority) the client sent, always known (a Host
    # without one means the scheme's default).
    if SERVER_ADDRESS in attrs and SERVER_PORT not in attrs:
        out.append(f"{SERVER_PORT} missing: Conditionally Required when {SERVER_ADDRESS} is set")
    check_port(attrs, out)
    code = attrs.get(HTTP_RESPONSE_STATUS_CODE)
    if is_int(code):
        check_status_by_code(span, code, out, "a SERVER")


def check_client(span, out):
    attrs, status = span["attributes"], span["status"]
    for key in CLIENT_REQUIRED:
        if key not in attrs:
            out.append(f"{key} is Required on a CLIENT span and missing")
    method = method_rules(attrs, out)
    # No `{target}`: `url.template` is not stable, so `{method}` alone.
    if method is not None and span["name"] != method:
        out.append(f"named {span['name']!r}: the conventions say {method!r}")
    check_port(attrs, out)
    full = attrs.get(URL_FULL)
    if isinstance(full, str):
        check_url_full(full, attrs, out)
    code = attrs.get(HTTP_RESPONSE_STATUS_CODE)
    if is_int(code):
        # A response. The conventions say a CLIENT span's 4xx SHOULD be an
        # ERROR; our contract deliberately does not: the upstream's 4xx is
        # the client's answer, which the proxy passes on (it is the client's
        # to judge). So a CLIENT 4xx is UNSET without `error.type`, as on the
        # SERVER span; ERROR and `error.type` = the code on a 5xx only.
        check_status_by_code(span, code, out, "a CLIENT")
    elif code is None:
        # No response: what went wrong is `error.type`, and the span is an ERROR.
        if not attrs.get(ERROR_TYPE):
            out.append(f"neither {HTTP_RESPONSE_STATUS_CODE} nor {ERROR_TYPE}: no response says why")
        if status["code"] != "ERROR":
            out.append(f"status {status['code']} with no response ({ERROR_TYPE} = {attrs.get(ERROR_TYPE)!r}): ERROR")


def check_url_full(full, attrs, out):
    u = urllib.parse.urlsplit(full)
    if not u.scheme or not u.netloc:
        out.append(f"{URL_FULL} = {full!r}: not absolute (scheme://host...)")
        return
    if "?" in full:
        out.append(f"{URL_FULL} = {full!r}: a query (we never record it)")
    if "#" in full:
        out.append(f"{URL_FULL} = {full!r}: a fragment")
    if "@" in u.netloc:
        out.append(f"{URL_FULL} = {full!r}: credentials (userinfo)")
        return
    # server.address and server.port are the URL's origin.
    try:
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:
        out.append(f"{URL_FULL} = {full!r}: a port that is not one")
        return
    address = attrs.get(SERVER_ADDRESS)
    if address is not None and u.hostname != str(address).lower().strip("[]"):
        out.append(f"{SERVER_ADDRESS} = {address!r} is not the host of {URL_FULL} {full!r}")
    if SERVER_PORT in attrs and attrs[SERVER_PORT] != port:
        out.append(f"{SERVER_PORT} = {attrs[SERVER_PORT]!r} is not the port of {URL_FULL} {full!r}")


def check_internal(span, out):
    if not span["name"].startswith(OUR_NAMESPACE):
        out.append(f"an INTERNAL span of ours is named {OUR_NAMESPACE}*")
    for key in span["attributes"]:
        if not key.startswith(OUR_NAMESPACE):
            out.append(f"{key} on an INTERNAL span: only {OUR_NAMESPACE}* attributes there")
    if span["status"]["code"] != "UNSET":
        out.append(f"status {span['status']['code']}: INTERNAL spans leave it UNSET")


def check_span(span, reg):
    """The violations of one span (messages without the span's name)."""
    out = []
    check_attributes(span["attributes"], reg, out)
    kind = span["kind"]
    if span["status"]["code"] == "OK":
        out.append("status OK: instrumentation leaves OK to the application")
    if kind == "SERVER":
        check_server(span, out)
    elif kind == "CLIENT":
        check_client(span, out)
    elif kind == "INTERNAL":
        check_internal(span, out)
    else:
        out.append(f"kind {kind}: the proxy makes SERVER, CLIENT and INTERNAL spans only")
    return out


def read_spans(lines):
    """Spans from JSON lines; what is not one is reported as a violation."""
    spans, bad = [], []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            bad.append(f"line {n}: not JSON ({e})")
            continue
        if isinstance(obj, dict) and "listening" in obj:
            continue  # the receiver's first line
        if not (
            isinstance(obj, dict)
            and isinstance(obj.get("name"), str)
            and isinstance(obj.get("kind"), str)
            and isinstance(obj.get("attributes"), dict)
            and isinstance(obj.get("status"), dict)
            and "code" in obj["status"]
        ):
            bad.append(f"line {n}: not a span (name, kind, attributes, status): {line[:200]}")
            continue
        obj["status"].setdefault("message", "")
        spans.append(obj)
    return spans, bad


def check(lines, reg):
    """(header line, violations) for the spans in `lines`."""
    spans, violations = read_spans(lines)
    for name in reg.in_our_namespace():
        violations.append(f"registry: {name} is registered, inside our namespace {OUR_NAMESPACE}*")
    for span in spans:
        for v in check_span(span, reg):
            violations.append(f"span {span['name']} ({span['kind']}): {v}")
    if not spans:
        violations.append("no spans: nothing was checked")
    header = (
        f"semconv_check: {PACKAGE} {reg.version} "
        f"({len(reg.stable) + len(reg.stable_templates)} stable attribute names of "
        f"{len(reg.registered) + len(reg.registered_templates)} registered), "
        f"{len(spans)} spans checked"
    )
    return header, violations


# ---------------------------------------------------------------------------
# --self-test: good spans pass, each bad one is caught for what is wrong with it.


def span(name, kind, attributes, status="UNSET", message=""):
    return {
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "span_id": "b7ad6b7169203331",
        "parent_span_id": "",
        "name": name,
        "kind": kind,
        "attributes": attributes,
        "links": [],
        "resource": {"service.name": "idemproxy"},
        "scope": "idemproxy",
        "status": {"code": status, "message": message},
        "trace_state": "",
        "flags": 1,
        "start_time_unix_nano": 1,
        "end_time_unix_nano": 2,
        "export_path": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    }


def server(name="POST /v1/payments", status="UNSET", message="", drop=(), **attrs):
    a = {
        "http.request.method": "POST",
        "url.path": "/v1/payments",
        "url.scheme": "http",
        "http.route": "/v1/payments",
        "http.response.status_code": 201,
        "network.protocol.version": "1.1",
        "server.address": "127.0.0.1",
        "server.port": 8080,
        "client.address": "127.0.0.1",
        "idempotency.outcome": "forwarded",
        "idempotency.route": "payments",
        "idempotency.record_id": "ab" * 32,
    }
    a.update({k.replace("__", "."): v for k, v in attrs.items()})
    for k in drop:
        a.pop(k, None)
    return span(name, "SERVER", {k: v for k, v in a.items() if v is not None}, status, message)


def client(name="POST", status="UNSET", message="", drop=(), **attrs):
    a = {
        "http.request.method": "POST",
        "url.full": "http://127.0.0.1:9000/v1/payments",
        "server.address": "127.0.0.1",
        "server.port": 9000,
        "http.response.status_code": 201,
    }
    a.update({k.replace("__", "."): v for k, v in attrs.items()})
    for k in drop:
        a.pop(k, None)
    return span(name, "CLIENT", {k: v for k, v in a.items() if v is not None}, status, message)


def internal(name="idempotency.reserve", status="UNSET", **attrs):
    a = {"idempotency.route": "payments", "idempotency.record_id": "ab" * 32}
    a.update({k.replace("__", "."): v for k, v in attrs.items()})
    return span(name, "INTERNAL", a, status)


OTHER = {"http__request__method": "_OTHER", "http__request__method_original": "PURGE"}

GOOD = [
    server(),
    server("GET", http__request__method="GET", http__route=None, url__path="/things/7",
           idempotency__outcome="passthrough"),
    server(http__response__status_code=409, idempotency__original_trace_id="0a" * 16),
    server(status="ERROR", http__response__status_code=503, error__type="503"),
    server("HTTP /v1/purge", http__route="/v1/purge", **OTHER),
    server("HTTP", http__route=None, **OTHER),
    server(drop=("server.address", "server.port")),
    client(),
    client("GET", http__request__method="GET", url__full="http://127.0.0.1:9000/things"),
    client(http__response__status_code=404),
    client(status="ERROR", http__response__status_code=502, error__type="502"),
    client(status="ERROR", http__response__status_code=None, error__type="connect"),
    client(status="ERROR", message="connection refused", http__response__status_code=None,
           error__type="connect"),
    client("HTTP", **OTHER),
    client(url__full="https://api.example.com/v1/payments", server__address="api.example.com",
           server__port=443),
    internal(),
    internal("idempotency.wait"),
]

# (what is wrong, the span, a piece of the violation it must cause)
BAD = [
    ("an incubating attribute", server(http__request__body__size=10),
     "http.request.body.size is registered but not stable"),
    ("a deprecated attribute", server(http__method="POST"),
     "http.method is registered but not stable"),
    ("an attribute nobody registered", server(my__thing="x"),
     "my.thing is neither a registered attribute"),
    ("a method outside the stable enum", client("QUERY", http__request__method="QUERY"),
     "http.request.method = 'QUERY' is not one of"),
    ("an unknown method's span named _OTHER", server("_OTHER", http__route=None, **OTHER),
     "the conventions say 'HTTP'"),
    ("an unknown method's SERVER span named _OTHER {route}",
     server("_OTHER /v1/purge", http__route="/v1/purge", **OTHER),
     "the conventions say 'HTTP /v1/purge'"),
    ("_OTHER without the method sent",
     server("HTTP /v1/payments", http__request__method="_OTHER"),
     "http.request.method_original (the method sent) is missing"),
    ("_OTHER as the method sent",
     server("HTTP /v1/payments", http__request__method="_OTHER",
            http__request__method_original="_OTHER"),
     "http.request.method_original = '_OTHER': the method sent"),
    ("the method sent on a known method", client(http__request__method_original="POST"),
     "only when it is _OTHER"),
    ("a SERVER span without its route in the name", server("POST"),
     "the conventions say 'POST /v1/payments'"),
    ("a CLIENT span with a target", client("POST /v1/payments"), "the conventions say 'POST'"),
    ("a SERVER 5xx left UNSET", server(http__response__status_code=500, error__type="500"),
     "status UNSET on a 500: ERROR"),
    ("a SERVER 5xx without error.type", server(status="ERROR", http__response__status_code=500),
     "error.type = None on a 500"),
    ("a SERVER 5xx with another error.type",
     server(status="ERROR", http__response__status_code=502, error__type="connect"),
     "error.type = 'connect' on a 502"),
    ("a SERVER 4xx as an ERROR", server(status="ERROR", http__response__status_code=404),
     "status ERROR on a 404: UNSET"),
    ("a SERVER 2xx with error.type", server(error__type="oops"), "error.type = 'oops' on a 201"),
    ("a status message the code says", server(status="ERROR", message="Internal Server Error",
                                              http__response__status_code=500, error__type="500"),
     "status message 'Internal Server Error'"),
    ("status OK", server(status="OK"), "status OK"),
    ("a status code as a string", server(http__response__status_code="201"),
     "http.response.status_code = '201' (str): the conventions say int"),
    ("a status code as a bool", client(http__response__status_code=True),
     "http.response.status_code = True (bool): the conventions say int"),
    ("a SERVER span without url.scheme", server(drop=("url.scheme",)),
     "url.scheme is Required on a SERVER span"),
    ("a SERVER span without its status code", server(drop=("http.response.status_code",)),
     "http.response.status_code is Required on a SERVER span"),
    ("a SERVER span with server.address and no port", server(drop=("server.port",)),
     "server.port missing: Conditionally Required"),
    ("server.port without server.address", server(drop=("server.address",)),
     "server.port without server.address"),
    ("server.port out of range", server(server__port=0), "server.port = 0: not a port"),
    ("server.port as a string", client(server__port="9000"),
     "server.port = '9000' (str): the conventions say int"),
    ("a CLIENT span without server.port", client(drop=("server.port",)),
     "server.port is Required on a CLIENT span"),
    ("a CLIENT span without url.full", client(drop=("url.full",)),
     "url.full is Required on a CLIENT span"),
    ("url.full with a query", client(url__full="http://127.0.0.1:9000/v1/payments?a=1"),
     "a query"),
    ("url.full with a fragment", client(url__full="http://127.0.0.1:9000/v1/payments#f"),
     "a fragment"),
    ("url.full with credentials", client(url__full="http://u:p@127.0.0.1:9000/v1/payments"),
     "credentials"),
    ("url.full relative", client(url__full="/v1/payments"), "not absolute"),
    ("server.port not url.full's", client(server__port=9001), "is not the port of url.full"),
    ("server.address not url.full's", client(server__address="up"), "is not the host of url.full"),
    ("a CLIENT 5xx left UNSET", client(http__response__status_code=503, error__type="503"),
     "status UNSET on a 503: ERROR"),
    ("a CLIENT 4xx as an ERROR (our contract)",
     client(status="ERROR", http__response__status_code=404), "status ERROR on a 404: UNSET"),
    ("a CLIENT 4xx with error.type (our contract)",
     client(http__response__status_code=404, error__type="404"), "error.type = '404' on a 404"),
    ("no response left UNSET", client(http__response__status_code=None, error__type="connect"),
     "status UNSET with no response"),
    ("no response and no error.type", client(status="ERROR", http__response__status_code=None),
     "neither http.response.status_code nor error.type"),
    ("an INTERNAL span not ours", internal("reserve"), "named idempotency.*"),
    ("an INTERNAL span with an HTTP attribute", internal(http__route="/v1/payments"),
     "http.route on an INTERNAL span"),
    ("an INTERNAL span as an ERROR", internal(status="ERROR"), "INTERNAL spans leave it UNSET"),
    ("a kind we never make", span("idempotency.sweep", "PRODUCER", {}), "kind PRODUCER"),
    ("error.type that is not a string", client(status="ERROR", http__response__status_code=None,
                                               error__type=7),
     "error.type = 7 (int): the conventions say string"),
    ("our attribute as a list", server(idempotency__route=["a"]),
     "idempotency.route = ['a']: our attributes are scalars"),
]


def self_test(reg):
    failures = []

    def run(spans):
        return check([json.dumps(s) for s in spans], reg)

    # The registry as read: names, stability, enums.
    assert HTTP_REQUEST_METHOD in reg.stable and URL_FULL in reg.stable, reg.stable
    assert {"GET", "POST", "_OTHER"} <= reg.enums[HTTP_REQUEST_METHOD], reg.enums
    assert "QUERY" not in reg.enums[HTTP_REQUEST_METHOD]
    assert "http.method" in reg.registered and "http.method" not in reg.stable
    assert reg.stable_name("http.request.header.content-type") == "http.request.header"
    assert reg.in_our_namespace() == [], reg.in_our_namespace()

    checks = 0
    for good in GOOD:
        checks += 1
        _, violations = run([good])
        if violations:
            failures.append(f"a good span was refused: {violations}")
    checks += 1
    header, violations = run(GOOD)
    if violations or f"{len(GOOD)} spans checked" not in header:
        failures.append(f"the good spans together: {header} {violations}")
    for what, bad, expect in BAD:
        checks += 1
        _, violations = run([bad])
        if not any(expect in v for v in violations):
            failures.append(f"{what}: wanted {expect!r}, got {violations}")
    # Nothing to check is not a pass.
    checks += 3
    _, violations = check([], reg)
    if violations != ["no spans: nothing was checked"]:
        failures.append(f"no spans: {violations}")
    _, violations = check(["not json", '{"listening": 1}', '{"name": "x"}'], reg)
    if not (any("line 1: not JSON" in v for v in violations)
            and any("line 3: not a span" in v for v in violations)):
        failures.append(f"lines that are not spans: {violations}")
    # A registry that puts something in our namespace is caught, and our
    # attribute of that name too.
    reg.registered["idempotency.outcome"] = "fake.IDEMPOTENCY_OUTCOME"
    try:
        _, violations = run([server()])
    finally:
        del reg.registered["idempotency.outcome"]
    if not (any(v.startswith("registry: idempotency.outcome") for v in violations)
            and any("idempotency.outcome is ours but registered" in v for v in violations)):
        failures.append(f"a registered idempotency.* name: {violations}")

    print(f"semconv_check self-test: {PACKAGE} {reg.version}, {len(GOOD)} good spans, "
          f"{len(BAD)} bad ones")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"{checks - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="JSON lines of spans (stdin when none)")
    p.add_argument("--self-test", action="store_true",
                   help="check good and bad spans built here; exit 1 if a bad one passes")
    args = p.parse_args()
    reg = Registry()
    if args.self_test:
        sys.exit(self_test(reg))
    lines = []
    if args.files:
        for path in args.files:
            with open(path, encoding="utf-8") as f:
                lines.extend(f)
    else:
        lines = list(sys.stdin)
    header, violations = check(lines, reg)
    print(header)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} violation{'' if len(violations) == 1 else 's'}; distinct:")
        for v, n in summary(violations):
            print(f"  {n:4} x {v}")
    sys.exit(1 if violations else 0)


def summary(violations):
    """Each distinct violation, the span's name left out, with how often: the
    same rule broken by every request of a kind reads as one line."""
    counts = {}
    for v in violations:
        if v.startswith("span ") and "): " in v:
            name, _, rest = v.partition("): ")
            kind = name.rsplit("(", 1)[-1]
            v = f"{kind}: {rest}"
        counts[v] = counts.get(v, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


if __name__ == "__main__":
    main()
