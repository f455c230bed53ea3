//! `[telemetry]`: each key from the file or its standard OpenTelemetry
//! variable, the export headers and resource attributes, the endpoint's checks.

use toml::Spanned;

use crate::config::raw::RawTelemetry;
use crate::config::{ClientContext, ConfigError, OtlpProtocol, Source, TelemetryConfig};

/// The standard variables that fill in `[telemetry]` keys the file does not set.
const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
const OTEL_EXPORTER_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
const OTEL_EXPORTER_OTLP_HEADERS: &str = "OTEL_EXPORTER_OTLP_HEADERS";
const OTEL_EXPORTER_OTLP_TRACES_HEADERS: &str = "OTEL_EXPORTER_OTLP_TRACES_HEADERS";

/// A `[telemetry]` value from the file (at its span) or from a variable.
enum Told<T> {
    File(Spanned<T>),
    Env(&'static str, String),
}

/// `[telemetry]`: each key from the file, else from its standard variable
/// (`env` reads one; empty counts as unset), else its default. A wrong value
/// is an error at its place in the file, or naming its variable.
/// `OTEL_RESOURCE_ATTRIBUTES` and the export headers' variables have no key
/// in the file.
pub(in crate::config) fn telemetry(
    raw: RawTelemetry,
    src: &Source,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TelemetryConfig, ConfigError> {
    let told = |file: Option<Spanned<String>>, var: &'static str| -> Option<Told<String>> {
        match file {
            Some(v) => Some(Told::File(v)),
            None => env(var)
                .filter(|v| !v.trim().is_empty())
                .map(|v| Told::Env(var, v.trim().to_string())),
        }
    };
    let fail = |told: &Told<String>, key: &str, message: String| match told {
        Told::File(v) => src.entry(&v.span(), key, message),
        Told::Env(var, _) => ConfigError::Env { var, message },
    };
    let text = |told: &Told<String>| match told {
        Told::File(v) => v.get_ref().clone(),
        Told::Env(_, v) => v.clone(),
    };
    let mut t = TelemetryConfig::default();
    if let Some(told) = told(raw.otlp_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT) {
        let url = text(&told);
        check_otlp_endpoint(&url).map_err(|m| fail(&told, "telemetry.otlp_endpoint", m))?;
        t.otlp_endpoint = Some(url);
    }
    if let Some(told) = told(raw.otlp_protocol, OTEL_EXPORTER_OTLP_PROTOCOL) {
        let p = text(&told);
        t.otlp_protocol = OtlpProtocol::parse(&p).ok_or_else(|| {
            let m =
                format!("invalid OTLP protocol \"{p}\": expected \"grpc\" or \"http/protobuf\"");
            fail(&told, "telemetry.otlp_protocol", m)
        })?;
    }
    let service_name_told =
        raw.service_name.is_some() || env(OTEL_SERVICE_NAME).is_some_and(|v| !v.trim().is_empty());
    if let Some(told) = told(raw.service_name, OTEL_SERVICE_NAME) {
        let name = text(&told);
        if name.trim().is_empty() || name.chars().any(char::is_control) {
            let m = "invalid service name: empty, or with control characters".to_string();
            return Err(fail(&told, "telemetry.service_name", m));
        }
        t.service_name = name;
    }
    if let Some(r) = sample_ratio(raw.sample_ratio, src, env)? {
        t.sample_ratio = r;
    }
    if let Some(v) = raw.client_context {
        t.client_context = ClientContext::parse(v.get_ref()).ok_or_else(|| {
            let m = format!(
                "invalid client_context \"{}\": expected \"follow\", \"link\" or \"ignore\"",
                v.get_ref()
            );
            src.entry(&v.span(), "telemetry.client_context", m)
        })?;
    }
    t.resource_attributes = listed(OTEL_RESOURCE_ATTRIBUTES, env)?;
    // OpenTelemetry's order: the file or OTEL_SERVICE_NAME, then the
    // resource attribute, then the default.
    if !service_name_told {
        let named = t
            .resource_attributes
            .iter()
            .find(|(k, _)| k == "service.name");
        if let Some((_, name)) = named.filter(|(_, v)| !v.trim().is_empty()) {
            t.service_name = name.clone();
        }
    }
    t.headers = export_headers(env)?;
    Ok(t)
}

/// `sample_ratio`, from the file or `OTEL_TRACES_SAMPLER_ARG`: a number
/// from 0.0 to 1.0; `None` when neither gives one.
fn sample_ratio(
    file: Option<Spanned<f64>>,
    src: &Source,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<f64>, ConfigError> {
    let ratio = match file {
        Some(v) => Some(Told::File(v)),
        None => env(OTEL_TRACES_SAMPLER_ARG)
            .filter(|v| !v.trim().is_empty())
            .map(|v| Told::Env(OTEL_TRACES_SAMPLER_ARG, v.trim().to_string())),
    };
    let Some(told) = ratio else {
        return Ok(None);
    };
    let (value, fail_at): (Option<f64>, Box<dyn Fn(String) -> ConfigError>) = match &told {
        Told::File(v) => {
            let span = v.span();
            (
                Some(*v.get_ref()),
                Box::new(move |m| src.entry(&span, "telemetry.sample_ratio", m)),
            )
        }
        Told::Env(var, v) => (
            v.parse::<f64>().ok(),
            Box::new(move |message| ConfigError::Env { var, message }),
        ),
    };
    match value {
        Some(r) if (0.0..=1.0).contains(&r) => Ok(Some(r)),
        _ => Err(fail_at(
            "invalid sample ratio: expected a number from 0.0 to 1.0".to_string(),
        )),
    }
}

/// A list variable's `key=value` pairs (none when it is unset).
fn listed(
    var: &'static str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(String, String)>, ConfigError> {
    match env(var) {
        Some(text) => key_values(&text).map_err(|message| ConfigError::Env { var, message }),
        None => Ok(Vec::new()),
    }
}

/// The export headers, from `OTEL_EXPORTER_OTLP_HEADERS` then
/// `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (which wins for a name in both).
fn export_headers(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, ConfigError> {
    let mut headers = Vec::new();
    for var in [
        OTEL_EXPORTER_OTLP_HEADERS,
        OTEL_EXPORTER_OTLP_TRACES_HEADERS,
    ] {
        for (name, value) in listed(var, env)? {
            // The name only: a value is often a secret.
            let bad = |what: &str| ConfigError::Env {
                var,
                message: format!("header \"{name}\": {what}"),
            };
            // Not named: what is not a header name may be a secret typed
            // `name: value` (HTTP's way), with an `=` in the value.
            let name =
                http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| ConfigError::Env {
                    var,
                    message: "an item's key is not a valid header name (write name=value, \
                          items separated by commas)"
                        .to_string(),
                })?;
            if EXPORT_FRAMING.contains(&name.as_str()) {
                return Err(bad("the proxy sets it itself; it cannot come from here"));
            }
            let mut value =
                http::HeaderValue::from_str(&value).map_err(|_| bad("not a valid header value"))?;
            value.set_sensitive(true);
            headers.retain(|(n, _)| *n != name);
            headers.push((name, value));
        }
    }
    Ok(headers)
}

/// Headers an export cannot take from the variables: its framing and
/// content type, which the proxy sets, and hop-by-hop ones.
const EXPORT_FRAMING: [&str; 10] = [
    "content-length",
    "content-type",
    "transfer-encoding",
    "host",
    "te",
    "connection",
    "upgrade",
    "keep-alive",
    "proxy-connection",
    "trailer",
];

/// A list in the form of `OTEL_RESOURCE_ATTRIBUTES` and
/// `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs separated by commas,
/// blanks around each trimmed, values percent-decoded (a later key wins).
/// Errors name an item by its place and key, never by its value (a
/// header's value is often a secret; so is what a mistyped item holds).
fn key_values(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    let items = text.split(',').map(str::trim).filter(|i| !i.is_empty());
    for (n, item) in items.enumerate() {
        let place = n + 1;
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!(
                "item {place} is not key=value (items are separated by commas; write a comma in a value as %2C)"
            ));
        };
        let key = key.trim();
        let key_ok = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'%' | b'"' | b'\\'));
        if !key_ok {
            return Err(format!("item {place}: invalid key"));
        }
        let value = percent_decoded(value.trim())
            .ok_or_else(|| format!("item {place} (\"{key}\"): invalid percent-encoding"))?;
        pairs.retain(|(k, _)| k != key);
        pairs.push((key.to_string(), value));
    }
    Ok(pairs)
}

/// `%XX` sequences decoded; the result must be UTF-8 without control characters.
fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let text = String::from_utf8(out).ok()?;
    (!text.chars().any(char::is_control)).then_some(text)
}

/// An OTLP endpoint: an `http://` URL with a host. (This build speaks to
/// the collector without TLS: an `https://` one is refused here rather than
/// every export failing later.)
fn check_otlp_endpoint(url: &str) -> Result<(), String> {
    // Only the scheme and the host are repeated: a path, a query or a
    // fragment may hold a token, and a URL that does not parse anything.
    let bad = |why: &str| format!("invalid OTLP endpoint \"{}\": {why}", shown_endpoint(url));
    // Not echoed when it does not parse, nor with a query: either may hold a secret.
    let uri: http::Uri = url
        .parse()
        .map_err(|_| "invalid OTLP endpoint: not a URL".to_string())?;
    // Not echoed: the URL holds a password. The exporter would not send it,
    // and the log line that names the endpoint would show it.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(
            "invalid OTLP endpoint: a user or password in the URL is not used \
             (and would be logged); remove it"
                .to_string(),
        );
    }
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "TLS to the collector is not supported; use http:// (a collector beside the proxy)",
            ))
        }
        _ => return Err(bad("expected http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("missing host"));
    }
    if uri.query().is_some() || url.contains('#') {
        return Err(bad("a query or a fragment is not allowed"));
    }
    let port = uri.authority().and_then(|a| a.as_str().rsplit_once(':'));
    if port.is_some_and(|(_, p)| !p.contains(']') && p.parse::<u16>().map_or(true, |n| n == 0)) {
        return Err(bad("the port is not a number from 1 to 65535"));
    }
    Ok(())
}

/// An endpoint as the proxy repeats it (errors, `--check`, its start-up
/// line): `scheme://host:port`, and `/…` when there is a path (it may hold a
/// token); nothing of a URL that does not parse.
pub fn shown_endpoint(url: &str) -> String {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return "(not a URL)".to_string();
    };
    let host = uri.host().unwrap_or_default();
    let port = uri
        .port()
        .map(|p| format!(":{}", p.as_str()))
        .unwrap_or_default();
    let path = match uri.path() {
        "" | "/" => "",
        _ => "/…",
    };
    format!("{}://{host}{port}{path}", uri.scheme_str().unwrap_or("?"))
}
