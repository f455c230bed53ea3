//! The tests' real servers, shared by the store's conformance tests
//! (`crates/store/tests`) and the workspace's integration tests (`tests/`):
//!
//! - `redis`: a `redis-server` of the test's own (`RedisServer`), and the
//!   topologies the scale-out tests need (`Cluster`, `SentinelSetup`,
//!   `master_and_replica`);
//! - `postgres`: a PostgreSQL of the test's own (`PgServer`), and a primary
//!   with a synchronous standby;
//! - `process`: free ports, children killed and reaped.
//!
//! Waits are on events with deadlines ([`eventually`]), never fixed sleeps.

use std::time::Duration;

use tokio::time::Instant;

mod postgres;
mod process;
mod redis;

pub use postgres::*;
pub use process::*;
pub use redis::*;

/// How long any single wait in a test may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// Polls `check` until it returns `Some`, or panics after `deadline` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A directory for files that outlive one test (the PostgreSQL template):
/// `tmp/` of the target directory the running test binary was built in
/// (`target/debug/deps/<test>` → `target/tmp`), else the system's.
pub fn target_tmp() -> std::path::PathBuf {
    let exe = std::env::current_exe().ok();
    let target = exe.as_deref().and_then(|e| {
        e.ancestors()
            .find(|a| a.file_name().is_some_and(|n| n == "deps"))
            .and_then(|deps| deps.parent()?.parent())
    });
    let dir = match target {
        Some(t) => t.join("tmp"),
        None => std::env::temp_dir().join("idemproxy-tests"),
    };
    std::fs::create_dir_all(&dir).expect("the tests' tmp directory");
    dir
}
