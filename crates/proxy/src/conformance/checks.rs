//! The rows the kit checks, in the order it prints them, each with its level.
//!
//! The levels follow draft-ietf-httpapi-idempotency-key-header-07, row by row
//! as docs/conformance.md#rows argues them: its 400, 409 and 422 answers are
//! SHOULD; refusing a reused or missing key at all is MUST (the resource "MUST
//! fail the request"); running a retry, or a duplicate in flight, a second
//! time is what the header exists to prevent, so those rows are MUST too.
//! PRACTICE rows are what implementations commonly do beyond the draft
//! (Stripe's replay of the original status and body, a replay marker header,
//! RFC 9457 problem documents, `Retry-After` on a 409).

use std::fmt;

use serde::Serialize;

/// How strongly a row is required: by the draft's own wording (`MUST`,
/// `SHOULD`) or by what implementations commonly do (`PRACTICE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Level {
    #[serde(rename = "MUST")]
    Must,
    #[serde(rename = "SHOULD")]
    Should,
    #[serde(rename = "PRACTICE")]
    Practice,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Must => "MUST",
            Level::Should => "SHOULD",
            Level::Practice => "PRACTICE",
        })
    }
}

/// One row's definition.
#[derive(Debug)]
pub struct Check {
    /// A stable id (the report's rows and the documentation use it).
    pub id: &'static str,
    pub level: Level,
    pub requirement: &'static str,
}

pub(crate) const RETRY_RUNS_ONCE: Check = Check {
    id: "retry-runs-once",
    level: Level::Must,
    requirement:
        "a retry (same key, same body) after the first finished does not run the operation again",
};

pub(crate) const RETRY_SAME_RESULT: Check = Check {
    id: "retry-same-result",
    level: Level::Must,
    requirement:
        "that retry gets the first request's result: a 2xx with the same body (as bytes or as JSON)",
};

pub(crate) const REPLAY_STATUS: Check = Check {
    id: "replay-status",
    level: Level::Practice,
    requirement: "the replay has the original status (a 201 replays as 201)",
};

pub(crate) const REPLAY_BYTES: Check = Check {
    id: "replay-bytes",
    level: Level::Practice,
    requirement: "the replay's body is byte-identical to the first answer's",
};

pub(crate) const REPLAY_HEADERS: Check = Check {
    id: "replay-headers",
    level: Level::Practice,
    requirement: "the replay repeats the first answer's Content-Type and Location",
};

pub(crate) const REPLAY_MARKER: Check = Check {
    id: "replay-marker",
    level: Level::Practice,
    requirement: "the replay is marked by a header (e.g. Idempotent-Replayed: true) that the first answer lacks",
};

pub(crate) const NEW_KEY_NEW_OPERATION: Check = Check {
    id: "new-key-new-operation",
    level: Level::Should,
    requirement:
        "another key with the same body is a new operation: it runs and gets its own answer",
};

pub(crate) const REUSE_REFUSED: Check = Check {
    id: "reuse-refused",
    level: Level::Must,
    requirement: "the same key with a different body is refused with a 4xx: neither run nor answered with the first's result",
};

pub(crate) const REUSE_422: Check = Check {
    id: "reuse-422",
    level: Level::Should,
    requirement: "that refusal is 422",
};

pub(crate) const MISSING_KEY_REFUSED: Check = Check {
    id: "missing-key-refused",
    level: Level::Must,
    requirement:
        "on a route that requires a key, a request without one is refused with a 4xx, not run",
};

pub(crate) const MISSING_KEY_400: Check = Check {
    id: "missing-key-400",
    level: Level::Should,
    requirement: "that refusal is 400",
};

pub(crate) const EMPTY_KEY_400: Check = Check {
    id: "empty-key-400",
    level: Level::Should,
    requirement: "an empty Idempotency-Key is refused with 400",
};

pub(crate) const LONG_KEY_400: Check = Check {
    id: "long-key-400",
    level: Level::Practice,
    requirement: "a key of 256 characters is refused with 400",
};

pub(crate) const IN_FLIGHT_409: Check = Check {
    id: "in-flight-409",
    level: Level::Should,
    requirement: "a duplicate sent while the first is still unanswered gets 409",
};

pub(crate) const CONCURRENT_RUNS_ONCE: Check = Check {
    id: "concurrent-runs-once",
    level: Level::Must,
    requirement: "simultaneous identical requests with one key run the operation at most once",
};

pub(crate) const RETRY_AFTER_409: Check = Check {
    id: "retry-after-409",
    level: Level::Practice,
    requirement: "every 409 carries Retry-After",
};

pub(crate) const PROBLEM_JSON: Check = Check {
    id: "problem-json",
    level: Level::Practice,
    requirement: "the 4xx refusals are application/problem+json (RFC 9457)",
};

pub(crate) const PRINCIPAL_SCOPE: Check = Check {
    id: "principal-scope",
    level: Level::Should,
    requirement: "another principal's request with the same key and body runs as its own, never gets the first principal's answer",
};

/// Every row, in the order of the table (the tests hold the judge and the
/// report to it).
#[cfg(test)]
pub(crate) const ALL: [&Check; 18] = [
    &RETRY_RUNS_ONCE,
    &RETRY_SAME_RESULT,
    &REPLAY_STATUS,
    &REPLAY_BYTES,
    &REPLAY_HEADERS,
    &REPLAY_MARKER,
    &NEW_KEY_NEW_OPERATION,
    &REUSE_REFUSED,
    &REUSE_422,
    &MISSING_KEY_REFUSED,
    &MISSING_KEY_400,
    &EMPTY_KEY_400,
    &LONG_KEY_400,
    &IN_FLIGHT_409,
    &CONCURRENT_RUNS_ONCE,
    &RETRY_AFTER_409,
    &PROBLEM_JSON,
    &PRINCIPAL_SCOPE,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_kebab_case() {
        let mut ids: Vec<&str> = ALL.iter().map(|c| c.id).collect();
        assert!(ids.iter().all(|id| id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')));
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), ALL.len());
    }
}
