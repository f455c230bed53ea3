//! gRPC through the proxy (§9), with a real tonic server as the upstream and
//! a real tonic client: pass-through unary and streaming calls, a protected
//! unary call executed once and replayed byte for byte with its trailers, a
//! released UNAVAILABLE, and the proxy's own refusals as gRPC errors.
//! (The services are written by hand, as tonic-build would generate them.)

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::uri::PathAndQuery;
use support::*;
use tokio::sync::Semaphore;
use tonic::codec::ProstCodec;
use tonic::codegen::{BoxFuture, Context, Poll, Service};
use tonic::{Code, Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Charge {
    #[prost(string, tag = "1")]
    account: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Receipt {
    #[prost(string, tag = "1")]
    id: String,
    /// How many times the upstream has run this key.
    #[prost(int64, tag = "2")]
    executions: i64,
}

const CHARGE: &str = "/pay.Payments/Charge";
const QUOTE: &str = "/pay.Payments/Quote";
const WATCH: &str = "/pay.Payments/Watch";

/// The upstream's state: executions per key, and a gate `x-hold` calls wait at.
struct Ledger {
    runs: Mutex<HashMap<String, i64>>,
    gate: Semaphore,
    held: Semaphore,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            runs: Mutex::default(),
            gate: Semaphore::new(0),
            held: Semaphore::new(0),
        }
    }
}

impl Ledger {
    fn runs(&self, key: &str) -> i64 {
        self.runs.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

/// `Charge` counts a run per `idempotency-key`; `x-fail: unavailable` answers
/// UNAVAILABLE (after counting); `x-hold` waits at the gate first.
async fn charge(ledger: Arc<Ledger>, req: Request<Charge>) -> Result<Response<Receipt>, Status> {
    let key = req
        .metadata()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if req.metadata().contains_key("x-hold") {
        ledger.held.add_permits(1);
        ledger.gate.acquire().await.unwrap().forget();
    }
    let executions = {
        let mut runs = ledger.runs.lock().unwrap();
        let n = runs.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    if req.metadata().contains_key("x-fail") {
        return Err(Status::unavailable("try again later"));
    }
    let mut resp = Response::new(Receipt {
        id: format!("ch_{key}_{}", req.get_ref().amount),
        executions,
    });
    resp.metadata_mut()
        .insert("x-upstream", "payments".parse().unwrap());
    Ok(resp)
}

/// A unary method, one that streams, and the gRPC plumbing around them.
#[derive(Clone)]
struct Payments(Arc<Ledger>);

struct Unary<F>(Arc<Ledger>, F);

impl<F, Fut> tonic::server::UnaryService<Charge> for Unary<F>
where
    F: Fn(Arc<Ledger>, Request<Charge>) -> Fut,
    Fut: std::future::Future<Output = Result<Response<Receipt>, Status>> + Send + 'static,
{
    type Response = Receipt;
    type Future = BoxFuture<Response<Receipt>, Status>;
    fn call(&mut self, req: Request<Charge>) -> Self::Future {
        Box::pin((self.1)(self.0.clone(), req))
    }
}

struct Watch;

// Status is what tonic streams carry; its size is tonic's choice.
#[allow(clippy::result_large_err)]
fn tick(i: i64) -> Result<Receipt, Status> {
    Ok(Receipt {
        id: format!("tick-{i}"),
        executions: i,
    })
}

type ReceiptStream = std::pin::Pin<
    Box<dyn tonic::codegen::tokio_stream::Stream<Item = Result<Receipt, Status>> + Send>,
>;

impl tonic::server::ServerStreamingService<Charge> for Watch {
    type Response = Receipt;
    type ResponseStream = ReceiptStream;
    type Future = BoxFuture<Response<ReceiptStream>, Status>;
    fn call(&mut self, req: Request<Charge>) -> Self::Future {
        let n = req.get_ref().amount;
        Box::pin(async move {
            let items = (1..=n).map(tick);
            let stream: ReceiptStream = Box::pin(tonic::codegen::tokio_stream::iter(items));
            Ok(Response::new(stream))
        })
    }
}

impl<B> Service<http::Request<B>> for Payments
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::BoxBody>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let ledger = self.0.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Receipt, Charge>::default());
            Ok(match req.uri().path() {
                CHARGE | QUOTE => grpc.unary(Unary(ledger, charge), req).await,
                WATCH => grpc.server_streaming(Watch, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "pay.Payments";
}

/// The tonic server on a port of its own.
async fn start_upstream() -> (Arc<Ledger>, String) {
    let ledger = Arc::new(Ledger::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let service = Payments(ledger.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (ledger, url)
}

/// A proxy (Redis store) in front of the tonic server, speaking h2c to it;
/// `Charge` is protected.
async fn start(route_extra: &str) -> (Arc<Ledger>, Proxy, RedisServer) {
    start_with(route_extra, "").await
}

/// As [`start`], with more `[store]` lines.
async fn start_with(route_extra: &str, store: &str) -> (Arc<Ledger>, Proxy, RedisServer) {
    let (ledger, upstream) = start_upstream().await;
    let redis = RedisServer::start().await;
    let routes = format!("[[routes]]\nname = \"charge\"\npath = \"{CHARGE}\"\n{route_extra}\n");
    let config = ConfigBuilder::new(&upstream)
        .server("upstream_protocol = \"h2c\"")
        .redis(&redis)
        .store(store)
        .routes(&routes)
        .build();
    (ledger, Proxy::start(&config).await, redis)
}

/// A tonic client of the proxy.
async fn client(proxy: &Proxy) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(proxy.url(""))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
}

/// One unary call with metadata.
async fn call(
    grpc: &mut tonic::client::Grpc<tonic::transport::Channel>,
    path: &'static str,
    amount: i64,
    metadata: &[(&'static str, &str)],
) -> Result<Response<Receipt>, Status> {
    let mut req = Request::new(Charge {
        account: "acct_1".into(),
        amount,
    });
    for (name, value) in metadata {
        req.metadata_mut().insert(*name, value.parse().unwrap());
    }
    grpc.ready().await.unwrap();
    let codec = ProstCodec::<Charge, Receipt>::default();
    grpc.unary(req, PathAndQuery::from_static(path), codec)
        .await
}

fn replayed<T>(r: &Response<T>) -> bool {
    r.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_unary_call_runs_once_and_its_retry_is_replayed() {
    let (ledger, proxy, _redis) = start("").await;
    let mut grpc = client(&proxy).await;
    let first = call(&mut grpc, CHARGE, 500, &[("idempotency-key", "k-1")])
        .await
        .unwrap();
    assert!(!replayed(&first));
    assert_eq!(first.get_ref().executions, 1);
    for _ in 0..3 {
        let again = call(&mut grpc, CHARGE, 500, &[("idempotency-key", "k-1")])
            .await
            .unwrap();
        assert!(replayed(&again), "a replay, marked");
        assert_eq!(again.get_ref(), first.get_ref(), "the same answer");
        assert_eq!(
            again.metadata().get("x-upstream").unwrap(),
            "payments",
            "with the upstream's metadata"
        );
    }
    assert_eq!(ledger.runs("k-1"), 1, "executed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_refusals_are_grpc_errors() {
    let (ledger, proxy, _redis) = start("").await;
    let mut grpc = client(&proxy).await;
    let missing = call(&mut grpc, CHARGE, 1, &[]).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(
        missing.message().contains("idempotency-key-missing"),
        "{missing:?}"
    );

    call(&mut grpc, CHARGE, 1, &[("idempotency-key", "k-2")])
        .await
        .unwrap();
    let other = call(&mut grpc, CHARGE, 2, &[("idempotency-key", "k-2")])
        .await
        .unwrap_err();
    assert_eq!(
        other.code(),
        Code::InvalidArgument,
        "a different request: {other:?}"
    );
    assert!(
        other.message().contains("idempotency-key-reused"),
        "{other:?}"
    );

    // While the first is in flight: ABORTED.
    let mut held = client(&proxy).await;
    let first = tokio::spawn(async move {
        call(
            &mut held,
            CHARGE,
            3,
            &[("idempotency-key", "k-3"), ("x-hold", "1")],
        )
        .await
    });
    let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
        .await
        .expect("the first call reached the upstream")
        .unwrap();
    let busy = call(&mut grpc, CHARGE, 3, &[("idempotency-key", "k-3")])
        .await
        .unwrap_err();
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    ledger.gate.add_permits(1);
    first.await.unwrap().unwrap();
    assert_eq!(ledger.runs("k-3"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_answer_releases_the_key() {
    let (ledger, proxy, _redis) = start("").await;
    let mut grpc = client(&proxy).await;
    let first = call(
        &mut grpc,
        CHARGE,
        1,
        &[("idempotency-key", "k-u"), ("x-fail", "1")],
    )
    .await
    .unwrap_err();
    assert_eq!(first.code(), Code::Unavailable, "relayed as it came");
    let retry = call(&mut grpc, CHARGE, 1, &[("idempotency-key", "k-u")])
        .await
        .unwrap();
    assert!(!replayed(&retry), "the key was released: executed again");
    assert_eq!(ledger.runs("k-u"), 2);
    // Not in release_grpc_statuses: stored, and the error is replayed.
    let (ledger, proxy, _redis) = start("release_grpc_statuses = [8]").await;
    let mut grpc = client(&proxy).await;
    for _ in 0..2 {
        let e = call(
            &mut grpc,
            CHARGE,
            1,
            &[("idempotency-key", "k-s"), ("x-fail", "1")],
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
    }
    assert_eq!(ledger.runs("k-s"), 1, "the stored error was replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprotected_unary_and_streaming_calls_pass_through() {
    let (ledger, proxy, _redis) = start("").await;
    let mut grpc = client(&proxy).await;
    for _ in 0..2 {
        call(&mut grpc, QUOTE, 1, &[("idempotency-key", "k-q")])
            .await
            .unwrap();
    }
    assert_eq!(ledger.runs("k-q"), 2, "not protected: every call runs");
    grpc.ready().await.unwrap();
    let req = Request::new(Charge {
        account: "a".into(),
        amount: 5,
    });
    let codec = ProstCodec::<Charge, Receipt>::default();
    let mut stream = grpc
        .server_streaming(req, PathAndQuery::from_static(WATCH), codec)
        .await
        .unwrap()
        .into_inner();
    let mut ids = Vec::new();
    while let Some(item) = stream.message().await.unwrap() {
        ids.push(item.id);
    }
    assert_eq!(ids, ["tick-1", "tick-2", "tick-3", "tick-4", "tick-5"]);
    assert!(
        stream.trailers().await.unwrap().is_some(),
        "trailers relayed"
    );
}

/// The same call twice at the HTTP/2 level: the replay's body and trailers
/// are the first answer's, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_byte_identical_with_its_trailers() {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let (ledger, proxy, _redis) = start("").await;
    let client: Client<_, Full<bytes::Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    // A gRPC message: uncompressed flag, length, then the protobuf bytes.
    let message = prost::Message::encode_to_vec(&Charge {
        account: "acct_9".into(),
        amount: 42,
    });
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let mut answers = Vec::new();
    for _ in 0..2 {
        let req = http::Request::post(proxy.url(CHARGE))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", "k-bytes")
            .body(Full::new(bytes::Bytes::from(framed.clone())))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers");
        answers.push((parts, collected.to_bytes(), trailers));
    }
    let (first, again) = (&answers[0], &answers[1]);
    assert_eq!(first.0.status, 200);
    assert_eq!(again.0.headers["idempotent-replayed"], "true");
    assert_eq!(again.1, first.1, "the message bytes");
    assert!(!first.1.is_empty());
    assert_eq!(again.2, first.2, "the trailers");
    assert_eq!(first.2["grpc-status"], "0");
    assert_eq!(ledger.runs("k-bytes"), 1);
}

/// Records sealed at rest (§10): a gRPC answer's trailers are sealed with
/// its headers and body, and the replay is still the upstream's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_grpc_answer_replays_with_its_trailers() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n").unwrap();
    let store = format!("encryption_key_file = \"{}\"", keys.display());
    let (ledger, proxy, redis) = start_with("", &store).await;
    let mut grpc = client(&proxy).await;
    let first = call(&mut grpc, CHARGE, 7, &[("idempotency-key", "k-sealed")])
        .await
        .unwrap();
    let again = call(&mut grpc, CHARGE, 7, &[("idempotency-key", "k-sealed")])
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(again.metadata().get("x-upstream").unwrap(), "payments");
    assert_eq!(ledger.runs("k-sealed"), 1);
    let key = format!("idemproxy:{}", idemproxy::key::record_id([], "k-sealed"));
    let mut c = redis.conn().await.unwrap();
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!((stored[0], stored[1]), (3, b'F'));
    for clear in [&b"grpc-status"[..], b"x-upstream", b"application/grpc"] {
        assert!(
            !stored.windows(clear.len()).any(|w| w == clear),
            "{} stored in the clear",
            String::from_utf8_lossy(clear)
        );
    }
}
