//! Endpoints of the tests' own, on a tokio listener: ones that answer in ways
//! no framework would, to see the kit end and judge them as it should.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a fake endpoint does with its n-th connection.
#[derive(Clone, Copy)]
pub enum Fake {
    /// A 201 to the first connection; to every later one `100 Continue`, again
    /// and again, never a final answer.
    Flood,
    /// A 201 with an order to the first connection; every later one closed unanswered.
    FirstOnly,
}

/// Listens on a port of its own; the task ends with the test's runtime.
pub async fn start(fake: Fake) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let url = format!(
        "http://{}/orders",
        listener.local_addr().expect("its address")
    );
    tokio::spawn(async move {
        let mut n = 0usize;
        while let Ok((stream, _)) = listener.accept().await {
            n += 1;
            tokio::spawn(serve(fake, n, stream));
        }
    });
    url
}

async fn serve(fake: Fake, n: usize, mut stream: TcpStream) {
    match fake {
        Fake::FirstOnly if n > 1 => {}
        Fake::Flood if n > 1 => {
            read_request(&mut stream).await;
            let burst = "HTTP/1.1 100 Continue\r\n\r\n".repeat(64);
            while stream.write_all(burst.as_bytes()).await.is_ok() {}
        }
        Fake::FirstOnly | Fake::Flood => {
            read_request(&mut stream).await;
            let body = r#"{"id": "ord_1"}"#;
            let answer = format!(
                "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
    }
}

/// Reads a request's head and its `Content-Length` body.
async fn read_request(stream: &mut TcpStream) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let Ok(n) = stream.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        seen.extend_from_slice(&buf[..n]);
        let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if seen.len() >= end + 4 + length {
            return;
        }
    }
}
