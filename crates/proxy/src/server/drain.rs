//! Draining on shutdown: connections finish, then the forward-and-store
//! tasks; at the end of the grace, what still waits is cut short.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::{info, warn};

use crate::app::App;

use super::Connections;

/// After `shutdown_grace`, how long requests cut short get to record their outcome.
const HARD_STOP_WINDOW: Duration = Duration::from_secs(2);

/// Draining: readiness off, open connections finish, then the forward-and-store
/// tasks; at the end of the grace, what still waits for the upstream is cut short.
pub(super) async fn drain(app: &App, grace: Duration, connections: Connections) {
    app.draining.store(true, Ordering::Release);
    let deadline = tokio::time::Instant::now() + grace;
    info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: draining connections"
    );
    connections.stop.cancel();
    connections.tasks.close();
    if tokio::time::timeout_at(deadline, connections.tasks.wait())
        .await
        .is_err()
    {
        warn!("shutdown grace ran out with connections still open");
    }
    app.tasks.close();
    if tokio::time::timeout_at(deadline, app.tasks.wait())
        .await
        .is_ok()
    {
        return;
    }
    // Requests still waiting for the upstream are treated like an upstream
    // timeout (`unknown_outcome` applies); they get a moment to record that.
    warn!(
        requests = app.tasks.len(),
        "shutdown grace ran out with requests in flight; cutting them short"
    );
    app.hard_stop.cancel();
    if tokio::time::timeout(HARD_STOP_WINDOW, app.tasks.wait())
        .await
        .is_err()
    {
        warn!(
            requests = app.tasks.len(),
            "requests did not record their outcome in time; their leases will free the keys"
        );
    }
}
