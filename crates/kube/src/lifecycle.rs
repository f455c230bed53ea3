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
    let mut seen = identity(certificates.files());
    let mut failed = false;
    // A look at the files still under way (a mount that stopped answering):
    // no other is started beside it, so stuck threads do not pile up.
    let mut looking: Option<tokio::task::JoinHandle<(Identity, Identity)>> = None;
    let mut tick = tokio::time::interval(CERTIFICATE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = asked.notified() => {}
            _ = tick.tick() => {
                if looking.as_ref().is_some_and(|l| !l.is_finished()) {
                    continue;
                }
                // Off the async workers: a stat on a hung mount blocks.
                let files = certificates.files().clone();
                let mut look = tokio::task::spawn_blocking(move || identity(&files));
                let now = match tokio::time::timeout(LOOK_DEADLINE, &mut look).await {
                    Ok(Ok(now)) => now,
                    Ok(Err(_)) => continue,
                    Err(_) => {
                        tracing::warn!(deadline = ?LOOK_DEADLINE, "the certificate files could not be looked at in time; the current certificate stays");
                        looking = Some(look);
                        continue;
                    }
                };
                looking = None;
                // A reload that failed (half a rotation) is tried again at
                // each look until it succeeds.
                if now == seen && !failed {
                    continue;
                }
                seen = now;
            }
        }
        failed = !reload_certificate(certificates.clone()).await;
    }
}

/// How long a look at the certificate files' identity may take.
const LOOK_DEADLINE: Duration = Duration::from_secs(10);

/// What tells a file changed: the device, inode, length and modification
/// time of what the path resolves to (`None`: unreadable). Kubernetes
/// swaps a Secret's files by a symlink to a new directory, whose files may
/// keep the old times but never the old inodes.
type Identity = Option<(u64, u64, u64, Option<SystemTime>)>;

fn identity(files: &TlsFiles) -> (Identity, Identity) {
    use std::os::unix::fs::MetadataExt;
    let of = |p: &std::path::Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.dev(), m.ino(), m.len(), m.modified().ok()))
    };
    (of(&files.cert_file), of(&files.key_file))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Secret's swap: new files, of the same length and given the old
    /// times, behind the same path. Times alone would miss it.
    #[test]
    fn a_file_swapped_with_the_old_times_is_seen_as_changed() {
        let dir = tempfile::tempdir().unwrap();
        let files = TlsFiles {
            cert_file: dir.path().join("tls.crt"),
            key_file: dir.path().join("tls.key"),
        };
        for f in [&files.cert_file, &files.key_file] {
            std::fs::write(f, b"one").unwrap();
        }
        let before = identity(&files);
        let times = std::fs::metadata(&files.cert_file)
            .unwrap()
            .modified()
            .unwrap();
        let swapped = dir.path().join("new.crt");
        std::fs::write(&swapped, b"two").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&swapped)
            .unwrap()
            .set_modified(times)
            .unwrap();
        std::fs::rename(&swapped, &files.cert_file).unwrap();
        let after = identity(&files);
        assert_eq!(before.0.unwrap().3, after.0.unwrap().3, "the same times");
        assert_ne!(before, after);
        assert_eq!(before.1, after.1, "the key is as it was");
    }
}
