//! gRPC through the proxy (§9), with a real tonic server as the upstream and
//! a real tonic client: pass-through unary and streaming calls, a protected
//! unary call executed once and replayed byte for byte with its trailers, a
//! released UNAVAILABLE, and the proxy's own refusals as gRPC errors: sent
//! Trailers-Only (seen frame by frame through the `h2` crate), so that
//! grpcio's retry policy (tests/peers/grpc_call.py) retries them.
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
    start_full(route_extra, "", store).await
}

/// As [`start`], with more `[server]` and `[store]` lines.
async fn start_full(
    route_extra: &str,
    server: &str,
    store: &str,
) -> (Arc<Ledger>, Proxy, RedisServer) {
    let (ledger, upstream) = start_upstream().await;
    let redis = RedisServer::start().await;
    let routes = format!("[[routes]]\nname = \"charge\"\npath = \"{CHARGE}\"\n{route_extra}\n");
    let config = ConfigBuilder::new(&upstream)
        .server("upstream_protocol = \"h2c\"")
        .server(server)
        .redis(&redis)
        .store(store)
        .routes(&routes)
        .build();
    (ledger, Proxy::in_process(&config, &[]).await, redis)
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

// ---------------------------------------------------------------------------
// The proxy's own errors as gRPC clients retry them (§9): Trailers-Only, one
// HEADERS frame with END_STREAM. A client's retry policy retries only a call
// that received no response headers before its status.

/// A `Charge` for `acct_1` as a message's bytes (what `call` sends).
fn charge_message(amount: i64) -> Vec<u8> {
    prost::Message::encode_to_vec(&Charge {
        account: "acct_1".into(),
        amount,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An HTTP/2 connection to the proxy through the `h2` crate, which shows
/// how an answer came: its frames, not only its parts.
async fn h2_connect(proxy: &Proxy) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    client
}

/// Sends a unary call (`message` framed as gRPC) and returns its answer to come.
async fn h2_send(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    proxy: &Proxy,
    metadata: &[(&str, &str)],
    message: &[u8],
) -> h2::client::ResponseFuture {
    let mut req = http::Request::post(proxy.url(CHARGE))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in metadata {
        req = req.header(*name, *value);
    }
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    let mut ready = client.clone().ready().await.unwrap();
    let (response, mut body) = ready.send_request(req.body(()).unwrap(), false).unwrap();
    body.send_data(framed.into(), true).unwrap();
    response
}

/// An answer as it came over HTTP/2.
struct Frames {
    head: http::response::Parts,
    /// The HEADERS frame carried END_STREAM: nothing came after it.
    ended_with_head: bool,
    data: Vec<bytes::Bytes>,
    /// A second HEADERS frame (trailers), if one came.
    trailers: Option<http::HeaderMap>,
}

async fn frames(response: h2::client::ResponseFuture) -> Frames {
    let (head, mut body) = tokio::time::timeout(DEADLINE, response)
        .await
        .expect("an answer")
        .unwrap()
        .into_parts();
    let ended_with_head = body.is_end_stream();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        data.push(chunk.unwrap());
    }
    let trailers = body.trailers().await.unwrap();
    Frames {
        head,
        ended_with_head,
        data,
        trailers,
    }
}

/// One call on a connection of its own, to its answer's frames.
async fn h2_call(proxy: &Proxy, metadata: &[(&str, &str)], message: &[u8]) -> Frames {
    let mut client = h2_connect(proxy).await;
    frames(h2_send(&mut client, proxy, metadata, message).await).await
}

/// The answer is a Trailers-Only gRPC error with `code`; returns its headers.
fn assert_trailers_only(f: &Frames, code: Code, kind: &str) -> http::HeaderMap {
    let h = &f.head.headers;
    assert_eq!(f.head.status, 200, "{h:?}");
    assert_eq!(
        h.get("grpc-status").map(|v| v.to_str().unwrap()),
        Some((code as i32).to_string().as_str()),
        "grpc-status in the one HEADERS frame (Trailers-Only): {h:?}, trailers {:?}",
        f.trailers
    );
    assert!(
        f.ended_with_head,
        "the HEADERS frame carries END_STREAM: {h:?}"
    );
    assert!(f.data.is_empty(), "no DATA frame: {:?}", f.data);
    assert!(
        f.trailers.is_none(),
        "no second HEADERS frame: {:?}",
        f.trailers
    );
    assert_eq!(h["content-type"], "application/grpc");
    let message = h["grpc-message"].to_str().unwrap();
    assert!(message.starts_with(kind), "{message}");
    h.clone()
}

fn pushback_ms(h: &http::HeaderMap) -> u64 {
    h.get("grpc-retry-pushback-ms")
        .unwrap_or_else(|| panic!("grpc-retry-pushback-ms: {h:?}"))
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_grpc_errors_are_one_headers_frame_with_end_stream() {
    let (ledger, proxy, mut redis) =
        start_full("lease = \"30s\"", "upstream_timeout = \"1s\"", "").await;
    let m = charge_message(1);

    let missing = h2_call(&proxy, &[], &m).await;
    assert_trailers_only(&missing, Code::InvalidArgument, "idempotency-key-missing");

    let first = h2_call(&proxy, &[("idempotency-key", "k-f")], &m).await;
    assert!(
        first.trailers.is_some(),
        "the upstream's own answer has trailers"
    );
    let other = h2_call(&proxy, &[("idempotency-key", "k-f")], &charge_message(2)).await;
    assert_trailers_only(&other, Code::InvalidArgument, "idempotency-key-reused");

    // In flight: ABORTED, with a pushback that is an estimate, not the 30 s lease.
    let mut held = client(&proxy).await;
    let holding = tokio::spawn(async move {
        call(
            &mut held,
            CHARGE,
            1,
            &[("idempotency-key", "k-h"), ("x-hold", "1")],
        )
        .await
    });
    let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
        .await
        .expect("the first call reached the upstream")
        .unwrap();
    let aborted = h2_call(&proxy, &[("idempotency-key", "k-h")], &m).await;
    let h = assert_trailers_only(&aborted, Code::Aborted, "request-in-progress");
    let pushback = pushback_ms(&h);
    assert!(
        (1..=2000).contains(&pushback),
        "pushback {pushback} ms: when the first is likely done, not the lease"
    );
    ledger.gate.add_permits(1);
    holding.await.unwrap().unwrap();

    // An outcome the proxy stored (the upstream timed out): its replay is
    // Trailers-Only too, marked as a replay.
    let mut c = client(&proxy).await;
    let timed_out = tokio::spawn(async move {
        let metadata = [("idempotency-key", "k-t"), ("x-hold", "1")];
        call(&mut c, CHARGE, 1, &metadata).await
    });
    let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
        .await
        .expect("the call reached the upstream")
        .unwrap();
    let e = timed_out.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    let stored = h2_call(&proxy, &[("idempotency-key", "k-t")], &m).await;
    let h = assert_trailers_only(&stored, Code::DeadlineExceeded, "upstream-timeout");
    assert_eq!(h["idempotent-replayed"], "true");
    ledger.gate.add_permits(1);

    // The store down: UNAVAILABLE, with a pushback of a second (Retry-After: 1).
    redis.stop();
    let down = h2_call(&proxy, &[("idempotency-key", "k-d")], &m).await;
    let h = assert_trailers_only(&down, Code::Unavailable, "store-unavailable");
    assert_eq!(pushback_ms(&h), 1000);
}

/// A call whose owner is taken for vanished (its reservation's time cut to
/// its afterlife, as if its lease had run out): the retry gets the unknown
/// outcome as a gRPC error, UNKNOWN `outcome-unknown`, Trailers-Only, stored
/// so and replayed so (docs/reference/behaviour.md#dead-owner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_owners_call_is_an_unknown_grpc_error_stored_and_replayed() {
    let (ledger, proxy, redis) = start("").await;
    let mut held = client(&proxy).await;
    let holding = tokio::spawn(async move {
        let metadata = [("idempotency-key", "k-v"), ("x-hold", "1")];
        call(&mut held, CHARGE, 1, &metadata).await
    });
    let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
        .await
        .expect("the first call reached the upstream")
        .unwrap();
    let keys = redis.keys().await;
    let cut: i64 = redis.cmd(&["PEXPIRE", &keys[0], "86399000"]).await;
    assert_eq!(
        cut, 1,
        "less than the 24 h afterlife left: the lease is over"
    );
    let m = charge_message(1);
    let unknown = h2_call(&proxy, &[("idempotency-key", "k-v")], &m).await;
    let h = assert_trailers_only(&unknown, Code::Unknown, "outcome-unknown");
    assert!(!h.contains_key("idempotent-replayed"));
    let again = h2_call(&proxy, &[("idempotency-key", "k-v")], &m).await;
    let h = assert_trailers_only(&again, Code::Unknown, "outcome-unknown");
    assert_eq!(h["idempotent-replayed"], "true");
    ledger.gate.add_permits(1);
    let _ = holding.await.unwrap();
    assert_eq!(ledger.runs("k-v"), 1, "never a second execution");
}

/// Over `max_connections` requests in progress, the answer made before any
/// handler runs (`proxy-busy`) is Trailers-Only too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_over_capacity_is_one_headers_frame_with_end_stream() {
    let (ledger, proxy, _redis) = start_full("", "max_connections = 2", "").await;
    let mut client = h2_connect(&proxy).await;
    let m = charge_message(1);
    let mut held = Vec::new();
    for key in ["k-c1", "k-c2"] {
        let metadata = [("idempotency-key", key), ("x-hold", "1")];
        held.push(h2_send(&mut client, &proxy, &metadata, &m).await);
    }
    for _ in 0..2 {
        let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
            .await
            .expect("both calls reached the upstream")
            .unwrap();
    }
    let busy = frames(h2_send(&mut client, &proxy, &[("idempotency-key", "k-c3")], &m).await).await;
    let h = assert_trailers_only(&busy, Code::Unavailable, "proxy-busy");
    assert_eq!(pushback_ms(&h), 1000);
    ledger.gate.add_permits(2);
    for response in held {
        let f = frames(response).await;
        assert_eq!(f.trailers.unwrap()["grpc-status"], "0");
    }
}

/// grpcio's retry policy (ABORTED retryable) retries the proxy's ABORTED by
/// itself while the first call runs, and gets the replay once it is done:
/// the proxy counts the ABORTED attempts and the one replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_retries_an_aborted_call_by_its_policy_and_gets_the_replay() {
    let (ledger, proxy, _redis) = start("").await;
    let mut held = client(&proxy).await;
    let first = tokio::spawn(async move {
        call(
            &mut held,
            CHARGE,
            5,
            &[("idempotency-key", "k-r"), ("x-hold", "1")],
        )
        .await
    });
    let _ = tokio::time::timeout(DEADLINE, ledger.held.acquire())
        .await
        .expect("the first call reached the upstream")
        .unwrap();
    let target = proxy.addr.to_string();
    let request = hex(&charge_message(5));
    let retrying = tokio::spawn(async move {
        run_peer("grpc_call.py", &[&target, CHARGE, &request, "k-r", "5"]).await
    });
    let conflicts = "idemproxy_requests_total{route=\"charge\",outcome=\"conflict\"}";
    // (A peer that could not run ends the wait at once: its task failed.)
    eventually(
        "grpcio's first attempt answered ABORTED",
        DEADLINE,
        || async {
            let aborted = metric(&proxy, conflicts).await >= 1.0;
            (aborted || retrying.is_finished()).then_some(())
        },
    )
    .await;
    ledger.gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    let out = retrying.await.unwrap();
    assert_eq!(
        out["ok"], true,
        "grpcio retried ABORTED until the replay: {out}"
    );
    let receipt = hex(&prost::Message::encode_to_vec(first.get_ref()));
    assert_eq!(
        out["response_hex"],
        receipt.as_str(),
        "the first call's answer"
    );
    assert_eq!(out["metadata"]["idempotent-replayed"], "true", "{out}");
    let aborted = metric(&proxy, conflicts).await;
    let replays = "idemproxy_requests_total{route=\"charge\",outcome=\"replayed\"}";
    assert_eq!(metric(&proxy, replays).await, 1.0);
    assert!(aborted >= 1.0);
    assert_eq!(ledger.runs("k-r"), 1, "executed once");
    eprintln!(
        "grpcio: {aborted} ABORTED attempt(s), then the replay, in {:.2} s",
        out["elapsed"].as_f64().unwrap()
    );
}

/// grpcio's retry policy (UNAVAILABLE retryable) retries the proxy's
/// UNAVAILABLE when the store is down: every attempt reaches the proxy, a
/// second apart (`grpc-retry-pushback-ms`), and once the store is back an
/// attempt goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_retries_unavailable_when_the_store_is_down() {
    let (ledger, proxy, mut redis) = start("").await;
    redis.stop();
    let target = proxy.addr.to_string();
    let request = hex(&charge_message(1));
    let out = run_peer("grpc_call.py", &[&target, CHARGE, &request, "k-down", "3"]).await;
    assert_eq!(out["ok"], false, "{out}");
    assert_eq!(out["code"], "UNAVAILABLE", "{out}");
    let refused = "idemproxy_requests_total{route=\"charge\",outcome=\"store_error\"}";
    assert_eq!(
        metric(&proxy, refused).await,
        3.0,
        "grpcio made its 3 attempts: {out}"
    );
    assert_eq!(ledger.runs("k-down"), 0);
    let elapsed = out["elapsed"].as_f64().unwrap();
    assert!(
        elapsed >= 1.9,
        "a second between attempts (pushback): {elapsed:.2} s"
    );

    // The store comes back while grpcio retries: the call goes through.
    let target = proxy.addr.to_string();
    let retrying = tokio::spawn(async move {
        run_peer("grpc_call.py", &[&target, CHARGE, &request, "k-back", "5"]).await
    });
    eventually("a first attempt refused", DEADLINE, || async {
        (metric(&proxy, refused).await >= 4.0).then_some(())
    })
    .await;
    redis.restart().await;
    let out = retrying.await.unwrap();
    assert_eq!(out["ok"], true, "retried until the store was back: {out}");
    assert_eq!(ledger.runs("k-back"), 1);
    eprintln!(
        "grpcio: {} refused attempt(s) while the store was down, then through, in {:.2} s",
        metric(&proxy, refused).await - 3.0,
        out["elapsed"].as_f64().unwrap()
    );
}
