//! Sending a spelling byte for byte: HTTP/1.1 written by hand on a raw `TcpStream`
//! (no client library would send most of them), HTTP/2 (h2c, prior knowledge) with the
//! `h2` crate for the spellings a `:path` can carry.

use std::net::SocketAddr;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::spellings::Case;
use crate::support::DEADLINE;

/// What the proxy answered to one send.
#[derive(Clone, Debug)]
pub struct Answer {
    /// 0 when there was no answer (the connection closed, the stream was reset).
    pub status: u16,
    /// The problem type's last path segment, when the answer is an RFC 9457 problem.
    pub problem: Option<String>,
    pub replayed: bool,
    /// No body at all (HTTP/1.1: nothing after the head): the proxy's own parse
    /// errors look like this, most frameworks' answers do not.
    pub empty: bool,
    /// Why there was no answer.
    pub error: Option<String>,
}

impl Answer {
    fn none(error: String) -> Answer {
        Answer {
            status: 0,
            problem: None,
            replayed: false,
            empty: true,
            error: Some(error),
        }
    }

    /// `201`, `201 (replay)`, `400 path-not-accepted`, `none (reset)`.
    pub fn describe(&self) -> String {
        let mut s = if self.status == 0 {
            "no answer".to_string()
        } else {
            self.status.to_string()
        };
        if let Some(p) = &self.problem {
            s.push_str(&format!(" {p}"));
        }
        if self.replayed {
            s.push_str(" (replay)");
        }
        if let Some(e) = &self.error {
            s.push_str(&format!(" ({e})"));
        }
        s
    }
}

/// The HTTP/1.1 request for `case` with `key`, as written on the wire.
pub fn h1_request(case: &Case, proxy: SocketAddr, key: &str) -> Vec<u8> {
    let mut req = Vec::new();
    req.extend_from_slice(case.method.as_bytes());
    req.push(b' ');
    req.extend_from_slice(&case.target(&proxy.to_string()));
    req.extend_from_slice(b" HTTP/1.1\r\n");
    let (content_type, body) = case.body();
    // An empty content type: no Content-Type header at all.
    let content_type = match content_type {
        "" => String::new(),
        t => format!("Content-Type: {t}\r\n"),
    };
    let mut head = format!(
        "Host: {proxy}\r\nIdempotency-Key: {key}\r\n{content_type}\
         Content-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in &case.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    req.extend_from_slice(head.as_bytes());
    req
}

/// Sends `request` on a connection of its own and reads the answer to the end.
pub async fn send_h1(proxy: SocketAddr, request: &[u8]) -> Answer {
    let exchange = async {
        let mut tcp = TcpStream::connect(proxy).await.map_err(|e| e.to_string())?;
        tcp.write_all(request).await.map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        // A reset after a complete answer still leaves the answer in `buf`.
        let _ = tcp.read_to_end(&mut buf).await;
        Ok::<_, String>(buf)
    };
    let buf = match tokio::time::timeout(DEADLINE, exchange).await {
        Ok(Ok(buf)) => buf,
        Ok(Err(e)) => return Answer::none(e),
        Err(_) => return Answer::none("timed out".to_string()),
    };
    let text = String::from_utf8_lossy(&buf);
    // HTTP/1.0 too: the proxy relays the version of an upstream that answers 1.0 (aiohttp
    // to a request it cannot parse).
    let Some(status) = text
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|s| s.parse().ok())
    else {
        return Answer::none("closed".to_string());
    };
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let head = head.to_ascii_lowercase();
    Answer {
        status,
        problem: head
            .contains("content-type: application/problem+json")
            .then(|| problem_type(body))
            .flatten(),
        replayed: head.contains("idempotent-replayed: true"),
        empty: body.is_empty() || body == "0\r\n\r\n",
        error: None,
    }
}

/// Sends `case` twice with `key` on one HTTP/2 connection (prior knowledge).
pub async fn send_h2_twice(proxy: SocketAddr, case: &Case, key: &str) -> [Answer; 2] {
    let attempt = async {
        let tcp = TcpStream::connect(proxy).await.map_err(|e| e.to_string())?;
        let (client, conn) = h2::client::handshake(tcp)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut answers = Vec::new();
        for _ in 0..2 {
            answers.push(send_h2(client.clone(), proxy, case, key).await);
        }
        Ok::<_, String>(answers)
    };
    match tokio::time::timeout(DEADLINE, attempt).await {
        Ok(Ok(answers)) => [answers[0].clone(), answers[1].clone()],
        Ok(Err(e)) => [Answer::none(e.clone()), Answer::none(e)],
        Err(_) => [
            Answer::none("timed out".into()),
            Answer::none("timed out".into()),
        ],
    }
}

async fn send_h2(
    client: h2::client::SendRequest<Bytes>,
    proxy: SocketAddr,
    case: &Case,
    key: &str,
) -> Answer {
    let pq = String::from_utf8(case.path_and_query()).expect("an HTTP/2 :path is ASCII");
    let (content_type, body) = case.body();
    let mut req = http::Request::builder()
        .method(case.method.as_str())
        .uri(format!("http://{proxy}{pq}"))
        .header("idempotency-key", key);
    if !content_type.is_empty() {
        req = req.header("content-type", content_type);
    }
    for (name, value) in &case.headers {
        req = req.header(name.to_ascii_lowercase(), value);
    }
    let req = match req.body(()) {
        Ok(r) => r,
        Err(e) => return Answer::none(format!("not an HTTP/2 request: {e}")),
    };
    let result = async {
        let mut client = client.ready().await.map_err(|e| e.to_string())?;
        let (resp, mut stream) = client.send_request(req, false).map_err(|e| e.to_string())?;
        stream
            .send_data(Bytes::from_static(body.as_bytes()), true)
            .map_err(|e| e.to_string())?;
        let resp = resp.await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let is_problem = resp
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
        let replayed = resp
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let mut body = resp.into_body();
        let mut bytes = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
        }
        Ok::<_, String>(Answer {
            status,
            problem: is_problem
                .then(|| problem_type(&String::from_utf8_lossy(&bytes)))
                .flatten(),
            replayed,
            empty: bytes.is_empty(),
            error: None,
        })
    };
    result.await.unwrap_or_else(Answer::none)
}

/// The last segment of a problem's `type` (`.../path-not-accepted` → `path-not-accepted`).
fn problem_type(body: &str) -> Option<String> {
    // The body may be chunked on HTTP/1.1: find the JSON object rather than parse all.
    let start = body.find('{')?;
    let end = body.rfind('}')?;
    let v: serde_json::Value = serde_json::from_str(body.get(start..=end)?).ok()?;
    let t = v.get("type")?.as_str()?;
    Some(t.rsplit('/').next().unwrap_or(t).to_string())
}
