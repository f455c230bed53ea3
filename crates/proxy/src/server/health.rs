//! The store health check: pings that keep `/readyz` and `idemproxy_store_up` current.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::app::App;

/// How often the store is pinged once it has answered (faster before that).
const PING_EVERY: Duration = Duration::from_secs(2);

/// Pings the store: marks it answered (for `/readyz`) and keeps `idemproxy_store_up` current.
pub(super) async fn ping_store(app: Arc<App>) {
    loop {
        let ok = match app.store.ping().await {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "store ping failed");
                false
            }
        };
        if ok && !app.store_answered.swap(true, Ordering::AcqRel) {
            info!("store answered");
        }
        let wait = if app.store_answered.load(Ordering::Acquire) {
            PING_EVERY
        } else {
            Duration::from_millis(250)
        };
        tokio::time::sleep(wait).await;
    }
}
