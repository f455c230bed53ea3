//! `idemproxy conformance`: a black-box kit that drives any endpoint claiming Idempotency-Key support.
//!
//! The kit controls only its requests (docs/conformance.md): fresh keys per
//! run, the method, route, body and headers it is given. [`probe`] sends the
//! checks' requests in turn, [`judge`] turns what came back into rows
//! ([`checks`] defines them, with their MUST/SHOULD/PRACTICE levels), and
//! [`report`] prints the table and writes the JSON. The exit code is 0 when
//! no MUST row failed, 1 when one did, 2 when the endpoint cannot be
//! exercised (unreachable, or a first request with a fresh key is not a 2xx).

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{Method, Uri};

pub(crate) mod checks;
pub mod client;
pub mod judge;
pub mod probe;
pub mod report;
pub mod tls;

pub(crate) use probe::ProbeError;
pub use report::{Report, Row};

/// The body when `--body` is not given: JSON, numbered per request.
pub const DEFAULT_BODY: &str =
    r#"{"amount": {{seq}}, "reference": "idemproxy conformance {{run}}"}"#;
/// Simultaneous duplicates in the concurrency check, unless told otherwise.
pub const DEFAULT_CONCURRENCY: usize = 8;

/// A bad argument, found before anything is sent.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{0:?} is not a URL: {1}")]
    Url(String, String),
    #[error("{0}: only http:// and https:// URLs are supported")]
    Scheme(String),
    #[error("--route {0:?} must be a path starting with '/'")]
    Route(String),
    #[error("--header {0:?} must be 'Name: value': {1}")]
    Header(String, String),
    #[error(
        "--body must contain {{{{seq}}}}: the kit numbers its requests' bodies to tell them apart"
    )]
    Template,
    #[error("--concurrency must be at least 2")]
    Concurrency,
    #[error(transparent)]
    Tls(#[from] tls::TlsSetupError),
}

/// What a run is told to do.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where the requests go: the URL with `--route` as its path.
    pub target: Uri,
    pub method: Method,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub key_header: HeaderName,
    pub template: String,
    pub executions: Option<Uri>,
    pub key_optional: bool,
    pub other_principal: Option<(HeaderName, HeaderValue)>,
    pub concurrency: usize,
    pub timeout: Duration,
    /// For `https://` URLs ([`tls_for`]).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl Settings {
    /// Checks the template and the concurrency; the rest is parsed by the helpers below.
    pub fn check(&self) -> Result<(), SettingsError> {
        if !self.template.contains("{{seq}}") {
            return Err(SettingsError::Template);
        }
        if self.concurrency < 2 {
            return Err(SettingsError::Concurrency);
        }
        Ok(())
    }
}

/// An `http://` or `https://` URL (what `--executions` takes, too).
pub fn http_url(text: &str) -> Result<Uri, SettingsError> {
    let uri: Uri = text
        .parse()
        .map_err(|e: http::uri::InvalidUri| SettingsError::Url(text.into(), e.to_string()))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        Some("http" | "https") => Err(SettingsError::Url(text.into(), "no host".into())),
        _ => Err(SettingsError::Scheme(text.into())),
    }
}

/// The TLS client when the target or the counter is `https://` (`None` otherwise):
/// trusting `ca_file`'s certificates, or the system's roots without one.
pub fn tls_for(
    target: &Uri,
    executions: Option<&Uri>,
    ca_file: Option<&Path>,
) -> Result<Option<Arc<rustls::ClientConfig>>, SettingsError> {
    let https = |u: &Uri| u.scheme_str() == Some("https");
    if !https(target) && !executions.is_some_and(https) {
        return Ok(None);
    }
    Ok(Some(tls::client_config(ca_file)?))
}

/// The URL with `route` as its path and query; without a route, the URL's own (`/` when none).
pub fn target(url: &str, route: Option<&str>) -> Result<Uri, SettingsError> {
    let base = http_url(url)?;
    let Some(route) = route else {
        return Ok(base);
    };
    if !route.starts_with('/') {
        return Err(SettingsError::Route(route.into()));
    }
    let mut parts = base.into_parts();
    parts.path_and_query = Some(
        route
            .parse()
            .map_err(|_| SettingsError::Route(route.into()))?,
    );
    Uri::from_parts(parts).map_err(|e| SettingsError::Url(url.into(), e.to_string()))
}

/// `Name: value`, as `--header` and `--other-principal` take it.
pub fn header_line(line: &str) -> Result<(HeaderName, HeaderValue), SettingsError> {
    let bad = |why: &str| SettingsError::Header(line.into(), why.into());
    let (name, value) = line.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad("bad name"))?;
    let value = HeaderValue::from_str(value.trim()).map_err(|_| bad("bad value"))?;
    Ok((name, value))
}

/// Runs every check against the target and judges the rows.
pub async fn run(settings: Settings) -> Result<Report, ProbeError> {
    let client = client::Client {
        uri: settings.target.clone(),
        method: settings.method.clone(),
        headers: settings.headers,
        timeout: settings.timeout,
        tls: settings.tls,
    };
    let probe = Arc::new(probe::Probe {
        client,
        key_header: settings.key_header,
        template: settings.template,
        counter: settings.executions.clone(),
        key_optional: settings.key_optional,
        other_principal: settings.other_principal,
        concurrency: settings.concurrency,
        run: uuid::Uuid::new_v4().to_string(),
        next_body: AtomicU64::new(0),
    });
    let observations = probe.observe().await?;
    let rows = judge::rows(&observations);
    Ok(Report::new(
        settings.target.to_string(),
        settings.method.to_string(),
        settings.executions.map(|u| u.to_string()),
        rows,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_replaces_the_path_and_only_http_is_taken() {
        let t = target("http://127.0.0.1:8080", Some("/v1/payments?x=1")).unwrap();
        assert_eq!(t.to_string(), "http://127.0.0.1:8080/v1/payments?x=1");
        let t = target("http://api.local/orders", None).unwrap();
        assert_eq!(t.path(), "/orders");
        assert_eq!(target("http://h:1", None).unwrap().path(), "/");
        assert_eq!(
            target("https://h/", None).unwrap().scheme_str(),
            Some("https")
        );
        assert!(matches!(
            target("ftp://h/", None),
            Err(SettingsError::Scheme(_))
        ));
        assert!(matches!(
            target("http://h/", Some("v1")),
            Err(SettingsError::Route(_))
        ));
        assert!(target("not a url", None).is_err());
    }

    #[test]
    fn header_lines_are_name_colon_value() {
        let (n, v) = header_line("Authorization: Bearer a:b").unwrap();
        assert_eq!(n, "authorization");
        assert_eq!(v, "Bearer a:b");
        assert!(header_line("no colon").is_err());
        assert!(header_line("bad name: x").is_err());
    }
}
