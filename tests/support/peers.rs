//! Client peers written in Python (tests/peers/*.py): grpcio with a retry
//! policy, urllib3 with its `Retry`. The interpreter is `IDEMPROXY_TEST_PYTHON`
//! (set by tests/run.sh to a venv that has them), else the target directory's `peers-venv`, else
//! `python3`; a missing package fails the test with what to install.

use std::path::PathBuf;
use std::process::Stdio;

use super::DEADLINE;

/// The Python the peers run with.
pub fn peer_python() -> PathBuf {
    if let Some(p) = std::env::var_os("IDEMPROXY_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    // target/debug/idemproxy: the target directory (where tests/run.sh made the
    // venv) is two levels up, wherever CARGO_TARGET_DIR put it.
    let venv = PathBuf::from(env!("CARGO_BIN_EXE_idemproxy"))
        .ancestors()
        .nth(2)
        .expect("the target directory")
        .join("peers-venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// Runs `tests/peers/<script>` with `args` and returns the JSON object it
/// prints; fails the test if it cannot run, errs, or takes longer than `DEADLINE`.
pub async fn run_peer(script: &str, args: &[&str]) -> serde_json::Value {
    let python = peer_python();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/peers")
        .join(script);
    let child = tokio::process::Command::new(&python)
        .arg(&path)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): set IDEMPROXY_TEST_PYTHON to a Python with grpcio and urllib3 (tests/run.sh makes one in target/peers-venv)",
                python.display()
            )
        });
    let out = tokio::time::timeout(DEADLINE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {DEADLINE:?}"))
        .expect("the peer's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}) with {}:\n{stderr}\n(set IDEMPROXY_TEST_PYTHON to a Python with grpcio and urllib3; tests/run.sh makes one in target/peers-venv)",
        out.status,
        python.display()
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
