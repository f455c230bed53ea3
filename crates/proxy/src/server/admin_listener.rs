//! The admin listener: its accept loop and its cap on connections open at once.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::admin;
use crate::app::App;
use crate::config::ServerConfig;
use crate::conn::{Busy, Guarded};

/// Admin requests' headers must arrive within this time.
const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Admin connections open at once (docs/reference/behaviour.md#admin-limits): probes, a scrape
/// or two and an
/// operator need a handful; beyond it a new one takes an idle one's place.
const ADMIN_MAX_CONNECTIONS: usize = 32;

/// The admin listener: at most `ADMIN_MAX_CONNECTIONS` at once, each with the
/// main listener's write and idle deadlines (a scraper that stops reading,
/// or a connection left open, holds nothing for long). At the cap a new
/// connection takes the place of the oldest one with no request in progress,
/// so connections held open (or trickling a head) cannot keep the kubelet's
/// probes out; only when every one is being answered is the new one closed.
pub(super) async fn serve_admin(app: Arc<App>, listener: TcpListener, server: ServerConfig) {
    let open = Arc::new(std::sync::Mutex::new(AdminConnections::default()));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                error!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let busy = Busy::default();
        let Some((id, evicted)) = admin_place(&open, &busy) else {
            warn!("admin connection closed: every admin connection is being answered");
            continue;
        };
        let io = Guarded::new(
            stream,
            busy.clone(),
            server.client_write_timeout,
            server.idle_timeout,
        );
        let app = app.clone();
        let service = service_fn(move |req| {
            let app = app.clone();
            // Counted while it is answered: a connection with a request in
            // progress is neither idle nor given up for a newer one.
            let in_progress = busy.enter();
            async move {
                let resp = admin::handle(app, req).await;
                drop(in_progress);
                Ok::<_, Infallible>(resp)
            }
        });
        let open = open.clone();
        tokio::spawn(async move {
            let serving = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(io), service);
            tokio::select! {
                _ = serving => {}
                () = evicted.cancelled() => {}
            }
            let mut open = open
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            open.list.retain(|c| c.id != id);
        });
    }
}

/// The admin connections open, oldest first.
#[derive(Default)]
struct AdminConnections {
    next: u64,
    list: std::collections::VecDeque<AdminConnection>,
}

struct AdminConnection {
    id: u64,
    busy: Busy,
    /// Closes the connection when a newer one takes its place.
    evict: CancellationToken,
}

/// A place among the admin connections for a new one (its id, and what closes
/// it), giving up the oldest idle one at the cap; `None` when all are busy.
fn admin_place(
    open: &std::sync::Mutex<AdminConnections>,
    busy: &Busy,
) -> Option<(u64, CancellationToken)> {
    let mut open = open
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if open.list.len() >= ADMIN_MAX_CONNECTIONS {
        let oldest_idle = open.list.iter().position(|c| c.busy.idle())?;
        if let Some(gone) = open.list.remove(oldest_idle) {
            gone.evict.cancel();
        }
    }
    open.next += 1;
    let (id, evict) = (open.next, CancellationToken::new());
    open.list.push_back(AdminConnection {
        id,
        busy: busy.clone(),
        evict: evict.clone(),
    });
    Some((id, evict))
}
