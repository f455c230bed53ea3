//! Child processes and ports: what every process-level helper needs.

use std::process::Child;

/// Kills a child process (SIGKILL) and reaps it; nothing when it is gone already.
pub fn kill_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A loopback port that was free a moment ago (for processes that cannot be given port 0).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A free port whose +10000 (a cluster node's bus port) is free too.
pub fn free_port_with_bus() -> u16 {
    loop {
        let port = free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}
