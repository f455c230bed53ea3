//! What every request has from its start to its access log line: its ids
//! (ours, and the client's `X-Request-Id` when it is not a UUID), its place in
//! `idemproxy_inflight` and among the requests in progress, the request
//! metric and the log line.

use std::sync::Arc;

use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;
use tracing::info;
use uuid::Uuid;

use super::{Ctx, Handled, UNPROTECTED, X_REQUEST_ID};
use crate::app::App;
use crate::body::Body;
use crate::conn::Caller;
use crate::grpc;
use crate::metrics::Counted;
use crate::permit::Permit;
use crate::routes::Route;
use crate::store::RecordKey;

/// What every request has from its start to its log line.
pub(super) struct Begun {
    start: Instant,
    /// `idemproxy_inflight`, right even when hyper drops the handler (client
    /// gone); handed over to an upstream exchange that outlives the handler.
    inflight: Option<Counted>,
    /// The request's place among the requests in progress.
    permit: Permit,
    request_id: Uuid,
    client_request_id: Option<String>,
    grpc: bool,
    pub(super) method: http::Method,
    /// A cheap clone (shared bytes), kept for the log line.
    pub(super) uri: http::Uri,
}

impl Begun {
    pub(super) fn new(app: &App, req: &Request<Incoming>, permit: Permit) -> Self {
        let (request_id, client_request_id) = request_ids(req.headers());
        Begun {
            start: Instant::now(),
            inflight: Some(Counted::new(&app.metrics.inflight)),
            permit,
            request_id,
            client_request_id,
            grpc: grpc::is_grpc(req.headers()),
            method: req.method().clone(),
            uri: req.uri().clone(),
        }
    }

    /// The request's context; with tracing on, its SERVER span starts here
    /// (under `route`, when one protects the request).
    pub(super) fn ctx<'c>(
        &self,
        app: &'c Arc<App>,
        caller: Caller,
        req: &Request<Incoming>,
        route: Option<&Route>,
    ) -> Ctx<'c> {
        let trace = app.telemetry.as_ref().map(|t| {
            let route = route.map(|r| (r.name.as_str(), r.path.as_str()));
            t.server_span(req, route, caller.scheme, caller.addr)
        });
        Ctx {
            app,
            caller,
            request_id: self.request_id,
            grpc: self.grpc,
            start: self.start,
            trace,
        }
    }

    /// What an upstream exchange that may outlive the handler takes with it:
    /// the request's place in `idemproxy_inflight` (it counts there until the
    /// exchange ends) and a share of its permit (the answer holds the other).
    pub(super) fn hand_over(&mut self) -> RequestPlace {
        RequestPlace {
            _inflight: self.inflight.take(),
            _permit: self.permit.share(),
        }
    }

    /// The request metric and the access log line; the answer, and the
    /// request's place among the requests in progress for it to hold.
    pub(super) fn finish(
        self,
        app: &App,
        ctx: &Ctx<'_>,
        route: Option<&Route>,
        handled: Handled,
    ) -> (Response<Body>, Permit) {
        let route_name = route.map_or(&*UNPROTECTED, |r| &r.name);
        match route {
            Some(route) => app
                .metrics
                .request_on(&route.name, &route.series, handled.outcome),
            None => app.metrics.request(route_name, handled.outcome),
        }
        let status = handled.response.status().as_u16();
        let record_id = handled.record_id.as_ref().map(RecordKey::id);
        let ids = ctx.trace.as_ref().and_then(|server| {
            let ids = server.log_ids();
            server.end(status, handled.outcome.as_str(), record_id);
            ids
        });
        let (trace_id, span_id) = ids.unzip();
        info!(
            target: "idemproxy::access",
            request_id = %ctx.request_id,
            method = %self.method,
            path = self.uri.path(),
            route = route_name.as_str(),
            outcome = handled.outcome.as_str(),
            status,
            duration_ms = millis(self.start.elapsed()),
            record_id,
            client_request_id = self.client_request_id,
            trace_id,
            span_id,
            "request"
        );
        (handled.response, self.permit)
    }
}

/// Milliseconds to the microsecond (`12.345`): a whole count of microseconds
/// divided once prints as written, where `as_secs_f64() * 1000.0` printed float noise (`12.345000000000001`).
fn millis(d: std::time::Duration) -> f64 {
    let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    micros as f64 / 1000.0
}

/// A request's place in `idemproxy_inflight` and among the requests in
/// progress, held by its upstream exchange until that ends
/// (docs/reference/behaviour.md#in-progress: a client that
/// goes away cannot multiply exchanges).
pub(crate) struct RequestPlace {
    _inflight: Option<Counted>,
    _permit: Permit,
}

/// An incoming `X-Request-Id` that is a UUID names the request; otherwise we
/// make one, and an incoming id of another form is logged beside it as
/// `client_request_id` (it is forwarded unchanged either way,
/// docs/reference/behaviour.md#request-id). Ours is sent
/// upstream only on protected routes, and only when the client sent none.
fn request_ids(headers: &HeaderMap) -> (Uuid, Option<String>) {
    let Some(given) = headers.get(X_REQUEST_ID) else {
        return (Uuid::new_v4(), None);
    };
    match given.to_str().map(Uuid::parse_str) {
        Ok(Ok(id)) => (id, None),
        _ => {
            let shown = String::from_utf8_lossy(given.as_bytes()).into_owned();
            (Uuid::new_v4(), Some(shown))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::millis;
    use std::time::Duration;

    #[test]
    fn durations_are_logged_as_written() {
        for (micros, text) in [
            (12_345, "12.345"),
            (1, "0.001"),
            (100_000, "100"),
            (999_999, "999.999"),
        ] {
            assert_eq!(millis(Duration::from_micros(micros)).to_string(), text);
        }
        // (The product of as_secs_f64 and 1000 is not: that was the noise in the logs.)
        assert_ne!(
            (Duration::from_micros(4_321).as_secs_f64() * 1000.0).to_string(),
            "4.321"
        );
        assert_eq!(millis(Duration::from_micros(4_321)).to_string(), "4.321");
    }
}
