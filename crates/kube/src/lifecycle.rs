//! The injector's life once bound: it serves until asked to stop, and
//! re-reads its certificate when asked to and when the files change.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_core::Stream;
use tokio::sync::Notify;

use idemproxy::config::TlsFiles;
use idemproxy::lifecycle::{reload_certificate, serve_until_shutdown, ProcessSignals, Signal};
use idemproxy::tls::Certificates;

use crate::webhook::Injector;

/// How often the injector looks at its certificate files' modification times.
pub(crate) const CERTIFICATE_POLL: Duration = Duration::from_secs(30);

/// Serves the webhook until the first [`Signal::Shutdown`] (or the end of
/// `signals`), then drains: reviews in progress are answered
/// (`webhook::DRAIN_GRACE` at most), idle connections closed. Its certificate is
/// re-read on each [`Signal::Reload`], and when its files change: in
/// Kubernetes, cert-manager renews it into a mounted Secret and no one
/// sends a signal.
pub async fn run(injector: Injector, signals: impl Stream<Item = Signal> + Unpin) {
    let asked = Arc::new(Notify::new());
    let reloader = tokio::spawn(reload_when_asked_or_changed(
        injector.certificates(),
        asked.clone(),
    ));
    serve_until_shutdown(signals, &asked, |stopped| {
        injector.run(async move {
            let _ = stopped.await;
        })
    })
    .await;
    reloader.abort();
}

/// The injector's [`ProcessSignals`].
pub fn process_signals() -> ProcessSignals {
    ProcessSignals::install(
        "cannot listen for SIGHUP; the certificate is re-read when its files change",
    )
}

async fn reload_when_asked_or_changed(certificates: Arc<Certificates>, asked: Arc<Notify>) {
    let mut seen = modified(certificates.files());
    let mut tick = tokio::time::interval(CERTIFICATE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = asked.notified() => {}
            _ = tick.tick() => {
                let now = modified(certificates.files());
                if now == seen {
                    continue;
                }
                seen = now;
            }
        }
        reload_certificate(certificates.clone()).await;
    }
}

/// When the certificate and key files were last modified (`None`: unreadable).
fn modified(files: &TlsFiles) -> (Option<SystemTime>, Option<SystemTime>) {
    let of = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    (of(&files.cert_file), of(&files.key_file))
}
