//! The requests of a run, check by check, each with keys of its own: what was sent and what came back.
//!
//! The kit controls only its requests. Keys are fresh UUIDs per run; bodies
//! come from the template with `{{seq}}` numbered per request, so that two
//! checks never send one body by accident; where a check needs the same body
//! twice it says so. Executions are counted exactly when a counter was given
//! (`--executions`: read before and after each check), and otherwise judged
//! from the answers' bodies (see `judge`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::Uri;
use tokio::sync::Barrier;

use super::client::{count_from, Client, Exchange, SendError};

/// A key longer than the 255 characters implementations commonly allow.
pub(crate) const LONG_KEY_CHARS: usize = 256;

/// An answer, or why there was none.
pub type Answer = Result<Exchange, String>;

/// One request of a check, and the executions the counter saw meanwhile.
#[derive(Debug)]
pub struct Attempt {
    pub answer: Answer,
    /// The counter's increase over the check (`--executions`), when it could be read.
    pub executions: Option<u64>,
}

/// The in-flight check: a first request, and its duplicate sent before the first was answered.
#[derive(Debug)]
pub struct InFlight {
    pub first: Answer,
    pub duplicate: Answer,
    /// How long after the first the duplicate was sent.
    pub delay: Duration,
    pub executions: Option<u64>,
}

/// The concurrency check: identical requests with one key, released at once.
#[derive(Debug)]
pub struct Concurrent {
    pub answers: Vec<Answer>,
    pub executions: Option<u64>,
}

/// The same key and body from two principals (`--other-principal`).
#[derive(Debug)]
pub struct PrincipalPair {
    pub first: Attempt,
    pub other: Attempt,
}

/// Everything a run saw, for `judge`.
#[derive(Debug)]
pub struct Observations {
    /// Key 1, body 1: the first request (a 2xx, or the run stops before this).
    pub first: Exchange,
    pub first_executions: Option<u64>,
    /// Key 1, body 1 again, once the first was answered.
    pub retry: Attempt,
    /// Key 2, body 1.
    pub new_key: Attempt,
    /// Key 1, another body.
    pub reuse: Attempt,
    /// No key (`None` with `--key-optional`).
    pub missing: Option<Attempt>,
    pub empty_key: Attempt,
    pub long_key: Attempt,
    pub in_flight: InFlight,
    pub concurrent: Concurrent,
    pub principal: Option<PrincipalPair>,
}

/// Why a run could not exercise the endpoint at all (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the endpoint cannot be reached: {0}")]
    Unreachable(SendError),
    #[error(
        "a first request with a fresh key was answered {status}, not 2xx, so nothing can be \
         checked (check the URL, --route, --method, --body and --header): {excerpt}"
    )]
    FirstRefused { status: u16, excerpt: String },
    #[error("the executions counter {uri}: {detail}")]
    Counter { uri: String, detail: String },
}

/// What a run sends, and how.
#[derive(Debug)]
pub struct Probe {
    pub client: Client,
    pub key_header: HeaderName,
    /// The body template; `{{seq}}` is numbered per request, `{{run}}` is the run's id.
    pub template: String,
    pub counter: Option<Uri>,
    pub key_optional: bool,
    pub other_principal: Option<(HeaderName, HeaderValue)>,
    pub concurrency: usize,
    /// This run's id (a UUID): part of every key and of `{{run}}`.
    pub run: String,
    pub next_body: AtomicU64,
}

impl Probe {
    /// Runs every check in turn; `Err` when the endpoint cannot be exercised at all.
    pub(crate) async fn observe(self: Arc<Self>) -> Result<Observations, ProbeError> {
        // Read first: a counter that cannot be read stops the run before it sends anything.
        let before = self.count().await?;
        let b1 = self.body();
        let k1 = self.key();
        let first = self.send_key(&k1, b1.clone()).await;
        let first = self.first_answer(first)?;
        let first_executions = self.delta(before).await;
        let retry = self.attempt(Some(&k1), b1.clone()).await;
        let new_key = self.attempt(Some(&self.key()), b1).await;
        let reuse = self.attempt(Some(&k1), self.body()).await;
        let missing = match self.key_optional {
            true => None,
            false => Some(self.attempt(None, self.body()).await),
        };
        let empty_key = self.attempt(Some(""), self.body()).await;
        let long = long_key(&self.run);
        let long_key = self.attempt(Some(&long), self.body()).await;
        let in_flight = self.clone().in_flight(first.latency()).await;
        let concurrent = self.clone().concurrent().await;
        let principal = match &self.other_principal {
            Some(other) => Some(self.principal_pair(other).await),
            None => None,
        };
        Ok(Observations {
            first,
            first_executions,
            retry,
            new_key,
            reuse,
            missing,
            empty_key,
            long_key,
            in_flight,
            concurrent,
            principal,
        })
    }

    /// A fresh key.
    fn key(&self) -> String {
        uuid::Uuid::new_v4().to_string()
    }

    /// The next body from the template.
    pub fn body(&self) -> Bytes {
        let n = self.next_body.fetch_add(1, Ordering::Relaxed) + 1;
        let text = self
            .template
            .replace("{{seq}}", &n.to_string())
            .replace("{{run}}", &self.run);
        Bytes::from(text)
    }

    fn key_line(&self, key: &str) -> Option<(HeaderName, HeaderValue)> {
        let value = HeaderValue::from_str(key).ok()?;
        Some((self.key_header.clone(), value))
    }

    async fn send_key(&self, key: &str, body: Bytes) -> Result<Exchange, SendError> {
        let extra: Vec<_> = self.key_line(key).into_iter().collect();
        self.client.send(&extra, body).await
    }

    /// The first request must be answered with a 2xx: nothing else can be checked otherwise.
    fn first_answer(&self, sent: Result<Exchange, SendError>) -> Result<Exchange, ProbeError> {
        let first = sent.map_err(ProbeError::Unreachable)?;
        if !first.status.is_success() {
            let text = String::from_utf8_lossy(&first.body);
            return Err(ProbeError::FirstRefused {
                status: first.status.as_u16(),
                excerpt: text.chars().take(200).collect(),
            });
        }
        Ok(first)
    }

    /// One request (`key`: `None` sends no key header), counted.
    async fn attempt(&self, key: Option<&str>, body: Bytes) -> Attempt {
        let before = self.count().await.ok().flatten();
        let answer = match key {
            Some(key) => self.send_key(key, body).await,
            None => self.client.send(&[], body).await,
        };
        Attempt {
            answer: answer.map_err(|e| e.to_string()),
            executions: self.delta(before).await,
        }
    }

    /// The first request, and its duplicate sent halfway through the first
    /// request's expected time (`typical`: how long the run's first request took).
    async fn in_flight(self: Arc<Self>, typical: Duration) -> InFlight {
        let key = self.key();
        let body = self.body();
        let before = self.count().await.ok().flatten();
        let delay = (typical / 2).min(self.client.timeout / 2);
        let probe = self.clone();
        let (k, b) = (key.clone(), body.clone());
        let first = tokio::spawn(async move { probe.send_key(&k, b).await });
        tokio::time::sleep(delay).await;
        let duplicate = self.send_key(&key, body).await;
        let first = match first.await {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        InFlight {
            first,
            duplicate: duplicate.map_err(|e| e.to_string()),
            delay,
            executions: self.delta(before).await,
        }
    }

    /// `concurrency` identical requests with one key, released together.
    async fn concurrent(self: Arc<Self>) -> Concurrent {
        let key = self.key();
        let body = self.body();
        let before = self.count().await.ok().flatten();
        let start = Arc::new(Barrier::new(self.concurrency));
        let mut tasks = Vec::with_capacity(self.concurrency);
        for _ in 0..self.concurrency {
            let (probe, key, body, start) =
                (self.clone(), key.clone(), body.clone(), start.clone());
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                probe.send_key(&key, body).await
            }));
        }
        let mut answers = Vec::with_capacity(tasks.len());
        for task in tasks {
            answers.push(match task.await {
                Ok(answer) => answer.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            });
        }
        Concurrent {
            answers,
            executions: self.delta(before).await,
        }
    }

    /// One key and body from the run's principal, then from the other one.
    async fn principal_pair(&self, other: &(HeaderName, HeaderValue)) -> PrincipalPair {
        let key = self.key();
        let body = self.body();
        let first = self.attempt(Some(&key), body.clone()).await;
        let before = self.count().await.ok().flatten();
        let mut extra: Vec<_> = self.key_line(&key).into_iter().collect();
        extra.push(other.clone());
        let answer = self.client.send(&extra, body).await;
        let other = Attempt {
            answer: answer.map_err(|e| e.to_string()),
            executions: self.delta(before).await,
        };
        PrincipalPair { first, other }
    }

    /// The counter's value now (`None` without `--executions`).
    async fn count(&self) -> Result<Option<u64>, ProbeError> {
        let Some(uri) = &self.counter else {
            return Ok(None);
        };
        let failed = |detail: String| ProbeError::Counter {
            uri: uri.to_string(),
            detail,
        };
        let answer = self
            .client
            .get(uri)
            .await
            .map_err(|e| failed(e.to_string()))?;
        if !answer.status.is_success() {
            return Err(failed(format!("answered {}", answer.status)));
        }
        match count_from(&answer.body) {
            Some(n) => Ok(Some(n)),
            None => Err(failed(
                "its answer is not a number, nor JSON with exactly one number".into(),
            )),
        }
    }

    /// How much the counter rose since `before` (`None` when either reading is missing).
    async fn delta(&self, before: Option<u64>) -> Option<u64> {
        let after = self.count().await.ok().flatten()?;
        Some(after.saturating_sub(before?))
    }
}

/// A valid token key of [`LONG_KEY_CHARS`] characters, unique to the run.
fn long_key(run: &str) -> String {
    let mut key = format!("{run}-");
    while key.len() < LONG_KEY_CHARS {
        key.push('x');
    }
    key.truncate(LONG_KEY_CHARS);
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_key_is_exactly_long_enough() {
        let key = long_key(&uuid::Uuid::new_v4().to_string());
        assert_eq!(key.chars().count(), LONG_KEY_CHARS);
        assert!(HeaderValue::from_str(&key).is_ok());
    }
}
