//! The sizes the performance work depends on, pinned. A request's future is
//! copied whole where it is made, so its size is paid on every request: the
//! request path boxes the large, rarely taken states where they start (a
//! tunnel, a large record's read, the upstream exchange of a protected
//! request, which runs in a task of its own) and keeps pass-through and the
//! protected path in futures of their own (`proxy::handle`). These tests fail
//! when one of those states finds its way back in.
//!
//! The bounds are for this test build (4.0 and 3.9 KiB, measured; a release
//! build's are 4.1 and 3.5 KiB), with room for compiler
//! changes; the exchange that must stay out is ~10 KiB on its own.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;

use crate::app::App;
use crate::body::{Body, Inbound};
use crate::config::{Config, Overrides};
use crate::conn::Caller;
use crate::permit::Permit;
use crate::proxy;

const CONFIG: &str = r#"
[server]
upstream = "http://127.0.0.1:9"

[[routes]]
name = "pay"
path = "/v1/pay"
"#;

/// The size of the future `proxy::handle` makes for each request, in order.
async fn handler_sizes(requests: Vec<Request<String>>) -> Vec<usize> {
    let config = Config::from_toml(CONFIG, "sizes.toml", &Overrides::default()).unwrap();
    let app: Arc<App> = App::new(&config).unwrap();
    let (sizes, mut measured) = mpsc::unbounded_channel();
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let caller = Caller {
            addr: ([127, 0, 0, 1], 1).into(),
            scheme: "http",
        };
        let handling = proxy::handle(app.clone(), req, caller, Permit::None);
        let _ = sizes.send(std::mem::size_of_val(&*handling));
        // Not run: only its size is wanted.
        drop(handling);
        async { Ok::<_, std::convert::Infallible>(Response::new(Body::full(""))) }
    });
    tokio::spawn(
        hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(server_io), service),
    );
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, http_body_util::Full<Bytes>>(TokioIo::new(
            client_io,
        ))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut out = Vec::new();
    for req in requests {
        let req = req.map(|b| http_body_util::Full::new(Bytes::from(b)));
        sender.send_request(req).await.unwrap();
        out.push(measured.recv().await.unwrap());
    }
    out
}

#[tokio::test]
async fn a_requests_future_holds_only_the_path_it_takes() {
    let pass_through = Request::get("http://h/elsewhere")
        .body(String::new())
        .unwrap();
    let protected = Request::post("http://h/v1/pay")
        .header("idempotency-key", "k-1")
        .body("{}".to_string())
        .unwrap();
    let sizes = handler_sizes(vec![pass_through, protected]).await;
    let (pass_through, protected) = (sizes[0], sizes[1]);
    eprintln!("pass-through {pass_through} B, protected path {protected} B");
    assert!(pass_through <= 5 * 1024, "pass-through: {pass_through} B");
    assert!(protected <= 5 * 1024, "the protected path: {protected} B");
}

#[test]
fn bodies_stay_small() {
    let (body, inbound) = (std::mem::size_of::<Body>(), std::mem::size_of::<Inbound>());
    eprintln!(
        "Body {body} B, Inbound {inbound} B, hyper's Incoming {} B",
        std::mem::size_of::<Incoming>()
    );
    // A client's body, or an upstream answer's with the connection it
    // drives: hyper's body and one pointer (the lent connection).
    assert!(
        inbound <= std::mem::size_of::<Incoming>() + 16,
        "Inbound: {inbound} B"
    );
    // A body is moved at every layer of an exchange: an enum whose largest
    // case is a buffered prefix (`Bytes`, 32 B) then a stream; no box per request.
    assert!(body <= inbound + 48, "Body: {body} B");
}
