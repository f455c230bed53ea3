//! A small "legacy payments API" with no idempotency of its own: every POST is a new charge.
//!
//! Used by the quickstart, the tests and the benchmarks.
//!
//! ```text
//! demo-upstream [--listen 127.0.0.1:3000] [--delay-ms 0]
//! POST /v1/payments      → 201, Location: /v1/payments/pay_N, JSON; counts a charge
//! GET  /v1/charges       → {"charges": N}
//! GET  /health           → ok
//! ```
//! A request header `x-demo-delay-ms: N` delays that one answer.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

struct Demo {
    charges: AtomicU64,
    delay: Duration,
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn handle(demo: Arc<Demo>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let delay = req
        .headers()
        .get("x-demo-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map_or(demo.delay, Duration::from_millis);
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return json(StatusCode::BAD_REQUEST, r#"{"error":"bad body"}"#.into()),
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    match (method, path.as_str()) {
        (Method::POST, "/v1/payments") => {
            let n = demo.charges.fetch_add(1, Ordering::SeqCst) + 1;
            let amount = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("amount").cloned())
                .unwrap_or(serde_json::Value::Null);
            let mut r = json(
                StatusCode::CREATED,
                serde_json::json!({ "id": format!("pay_{n}"), "status": "succeeded", "amount": amount, "charge_number": n })
                    .to_string(),
            );
            if let Ok(v) = header::HeaderValue::from_str(&format!("/v1/payments/pay_{n}")) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        (Method::GET, "/v1/charges") => json(
            StatusCode::OK,
            serde_json::json!({ "charges": demo.charges.load(Ordering::SeqCst) }).to_string(),
        ),
        (Method::GET, "/health") => json(StatusCode::OK, r#"{"ok":true}"#.into()),
        _ => json(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: demo-upstream [--listen ADDR] [--delay-ms N]");
        return Ok(());
    }
    let listen = arg(&args, "--listen").unwrap_or_else(|| "127.0.0.1:3000".to_string());
    let delay_ms: u64 = arg(&args, "--delay-ms")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let demo = Arc::new(Demo {
        charges: AtomicU64::new(0),
        delay: Duration::from_millis(delay_ms),
    });
    let listener = TcpListener::bind(&listen).await?;
    println!("demo upstream listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let demo = demo.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let demo = demo.clone();
                async move { Ok::<_, Infallible>(handle(demo, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
