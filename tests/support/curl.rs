//! curl, the client a user tries first: `curl` runs it with the test's arguments
//! (the protocol flag among them) and parses what `curl -i` printed.

/// One answer as `curl -i` printed it.
#[derive(Debug)]
pub struct Answer {
    /// "HTTP/2" or "HTTP/1.1".
    pub version: String,
    pub status: u16,
    /// Lower-case names, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The headers a replay repeats: all but the replay marker, the date and
    /// the cookies (a session is never handed to another client, §7).
    pub fn stored_headers(&self) -> Vec<(String, String)> {
        self.headers
            .iter()
            .filter(|(n, _)| !["idempotent-replayed", "date", "set-cookie"].contains(&n.as_str()))
            .cloned()
            .collect()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Runs `curl -s -i` with `args` (the protocol flag among them) and parses its answer.
pub async fn curl(args: &[&str]) -> Answer {
    let out = tokio::process::Command::new("curl")
        .args(["-s", "-i", "--max-time", "15"])
        .args(args)
        .output()
        .await
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let raw = out.stdout;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let mut words = status_line.split_whitespace();
    let version = words.next().expect("version").to_string();
    let status = words.next().and_then(|s| s.parse().ok()).expect("status");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Answer {
        version,
        status,
        headers,
        body: raw[end + 4..].to_vec(),
    }
}
