//! The admin listener: liveness, readiness, metrics, and the key admin API. Never exposed publicly.
//!
//! The key API (`/keys/...`) exists only when `IDEMPROXY_ADMIN_TOKEN` is set,
//! and every call must carry it as `Authorization: Bearer <token>`.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tracing::{info, warn};

use crate::app::App;
use crate::body::Body;
use crate::key;
use crate::problem;
use crate::record::{now_ms, Head};
use crate::store::StoreError;

/// A lookup request body is small; anything larger is refused.
const MAX_LOOKUP_BODY: usize = 64 * 1024;

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(Body::full(value.to_string()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    r
}

/// An admin API error: a problem document, rendered as the proxy's own problems are.
fn error(status: StatusCode, detail: &str) -> Response<Body> {
    let title = status.canonical_reason().unwrap_or("error");
    problem::response(
        status,
        &problem::document(status, "admin-error", title, detail),
    )
}

pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if path == "/keys" || path.starts_with("/keys/") {
        return keys(&app, req, &path).await;
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match path.as_str() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if app.is_ready() => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/metrics" => {
            let used = i64::try_from(app.budget.used()).unwrap_or(i64::MAX);
            app.metrics.buffered_bytes.set(used);
            let mut r = Response::new(Body::full(app.metrics.encode()));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            r
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// The key API: `GET /keys/{id}`, `DELETE /keys/{id}`, `POST /keys/lookup`.
async fn keys(app: &App, req: Request<Incoming>, path: &str) -> Response<Body> {
    // Switched off: indistinguishable from a path that does not exist.
    let Some(token) = &app.admin_token else {
        return text(StatusCode::NOT_FOUND, "not found\n");
    };
    let presented = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .unwrap_or_default();
    if !token.accepts(presented) {
        let mut r = error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        r.headers_mut().insert(
            WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"idemproxy-admin\""),
        );
        return r;
    }
    let method = req.method().clone();
    match (method, path.strip_prefix("/keys/")) {
        (Method::POST, Some("lookup")) => lookup(app, req).await,
        (Method::GET, Some(id)) if is_record_id(id) => match inspect(app, id).await {
            Ok(Some(view)) => json(StatusCode::OK, &view),
            Ok(None) => error(StatusCode::NOT_FOUND, "no record with this id"),
            Err(r) => r,
        },
        (Method::DELETE, Some(id)) if is_record_id(id) => {
            match app.store.delete(&app.store.key_for(id)).await {
                Ok(true) => {
                    info!(record_id = %id, "record deleted through the admin API");
                    json(
                        StatusCode::OK,
                        &serde_json::json!({ "id": id, "deleted": true }),
                    )
                }
                Ok(false) => error(StatusCode::NOT_FOUND, "no record with this id"),
                Err(e) => store_failed(e),
            }
        }
        (_, Some(id)) if is_record_id(id) || id == "lookup" => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET or DELETE /keys/{id}, POST /keys/lookup",
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            "record ids are 64 lower-case hex characters",
        ),
    }
}

fn is_record_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn store_failed(e: StoreError) -> Response<Body> {
    if let StoreError::Decode(e) = &e {
        warn!(error = %e, "admin API: the record cannot be read");
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "a value is stored under this id, but this build cannot read it",
        );
    }
    warn!(error = %e, "admin API: store operation failed");
    error(StatusCode::SERVICE_UNAVAILABLE, "the store did not answer")
}

/// The record as the admin API shows it; `Ok(None)` when there is none. Only
/// the record's clear head is read: a sealed record is shown without its key,
/// and no answer (headers, body) is ever at hand here.
async fn inspect(app: &App, id: &str) -> Result<Option<serde_json::Value>, Response<Body>> {
    let found = app
        .store
        .peek(&app.store.key_for(id))
        .await
        .map_err(store_failed)?;
    Ok(found.map(|(head, ttl)| view(id, &head, ttl)))
}

fn view(id: &str, head: &Head, ttl: std::time::Duration) -> serde_json::Value {
    let age_seconds = now_ms().saturating_sub(head.created_ms) / 1000;
    let mut v = serde_json::json!({
        "id": id,
        "route": head.route,
        "age_seconds": age_seconds,
        "expires_in_seconds": ttl.as_millis().div_ceil(1000) as u64,
    });
    match &head.finished {
        None => {
            v["state"] = "processing".into();
            // Kept its afterlife past its lease: 0 once the lease has run out
            // (its owner vanished, or renews late).
            if let Some(a) = head.afterlife {
                let lease_left = ttl.saturating_sub(a.after);
                v["lease_expires_in_seconds"] =
                    (lease_left.as_millis().div_ceil(1000) as u64).into();
            }
        }
        Some(f) => {
            v["state"] = "finished".into();
            v["status"] = f.status.into();
            v["body_stored"] = f.body_stored.into();
            v["sealed"] = head.sealed_with.is_some().into();
        }
    }
    if let Some(key_id) = &head.sealed_with {
        v["key_id"] = key_id.as_str().into();
    }
    v
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Lookup {
    /// The decoded key, as the client meant it (no sf-string quotes).
    key: String,
    /// Scope header values by name, as the client sent them (e.g. `authorization`).
    #[serde(default)]
    scope: std::collections::BTreeMap<String, String>,
}

async fn lookup(app: &App, req: Request<Incoming>) -> Response<Body> {
    let body: Bytes = match Limited::new(req.into_body(), MAX_LOOKUP_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the body is missing or larger than 64 KiB",
            )
        }
    };
    let lookup: Lookup = match serde_json::from_slice(&body) {
        Ok(l) => l,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "expected {{\"key\": \"...\", \"scope\": {{\"authorization\": \"...\"}}}}: {e}"
                ),
            )
        }
    };
    // Names lower-cased, in name order, as the proxy does for a request.
    let scope: std::collections::BTreeMap<String, String> = lookup
        .scope
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let id = key::record_id(
        scope.iter().map(|(k, v)| (k.as_str(), v.as_bytes())),
        &lookup.key,
    );
    match inspect(app, &id).await {
        Ok(Some(view)) => json(StatusCode::OK, &view),
        Ok(None) => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "id": id, "state": null }),
        ),
        Err(r) => r,
    }
}
