//! The floor of one client-facing HTTP/1.1 exchange on idemproxy's stack: a
//! hyper server built as idemproxy builds its own (a header-read timer, no
//! Nagle), answering every request with a fixed 50-byte JSON body from
//! memory, on one tokio worker. A replay is this exchange plus a Redis round
//! trip and the record's decoding, so what this costs per request bounds
//! what a replay can cost from below. `docs/benchmarks.md` has the figures.
//!
//!     cargo run --release --example hyper_floor -- 127.0.0.1:18700

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

const BODY: &[u8] = br#"{"id":"pay_1","status":"succeeded","amount":4200}"#;

async fn answer(_: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut resp = Response::new(Full::new(Bytes::from_static(BODY)));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18700".into());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(&addr).await?;
        eprintln!("hyper_floor listening on {addr}");
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
