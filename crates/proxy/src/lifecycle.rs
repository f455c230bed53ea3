//! The proxy's life once bound: it serves until asked to stop, re-reads what
//! can change while it runs when asked to, and flushes its last spans at the end.
//!
//! The asks are a stream of [`Signal`]s: [`ProcessSignals`] makes one of the
//! process's SIGHUP, SIGTERM and SIGINT (the binary); a test sends its own.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::signal::unix::{self, SignalKind};
use tokio::sync::{oneshot, Notify};

use crate::app::App;
use crate::config::{Config, Overrides};
use crate::seal;
use crate::server::Server;
use crate::telemetry::FLUSH_DEADLINE;
use crate::tls::Certificates;

/// What the process is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Re-read the configuration file, the certificate and the encryption keys (SIGHUP).
    Reload,
    /// Stop accepting, drain, end (SIGTERM, SIGINT).
    Shutdown,
}

/// Where a reload reads the configuration: the file and the command line's
/// overrides, as at start.
#[derive(Clone, Debug, Default)]
pub struct ConfigSource {
    /// `None`: the overrides alone (no `--config`).
    pub path: Option<PathBuf>,
    pub overrides: Overrides,
}

/// Serves until the first [`Signal::Shutdown`] (or the end of `signals`:
/// no one is left to ask), applying each [`Signal::Reload`] meanwhile, the
/// drain included; then flushes the last spans.
pub async fn run(
    server: Server,
    signals: impl Stream<Item = Signal> + Unpin,
    source: ConfigSource,
) {
    let app = server.app();
    let reloadable = Reloadable {
        app: app.clone(),
        certificates: server.certificates(),
        source,
    };
    let asked = Arc::new(Notify::new());
    let reloader = tokio::spawn(reload_when_asked(reloadable, asked.clone()));
    serve_until_shutdown(signals, &asked, |stopped| {
        server.run(async move {
            let _ = stopped.await;
        })
    })
    .await;
    reloader.abort();
    // A short deadline: a collector that is down does not hold up the exit.
    if let Some(telemetry) = &app.telemetry {
        telemetry.flush(FLUSH_DEADLINE);
    }
}

/// Runs what `serve` makes until it ends, telling it to stop (its
/// receiver resolves) at the first Shutdown or the end of `signals`; each
/// Reload meanwhile notifies `reloads`, which coalesces those that come
/// while one is being applied, as the kernel does with pending signals.
pub async fn serve_until_shutdown<F: Future<Output = ()>>(
    mut signals: impl Stream<Item = Signal> + Unpin,
    reloads: &Notify,
    serve: impl FnOnce(oneshot::Receiver<()>) -> F,
) {
    let (stop, stopped) = oneshot::channel::<()>();
    let mut stop = Some(stop);
    let serving = serve(stopped);
    tokio::pin!(serving);
    let mut listening = true;
    loop {
        let next = std::future::poll_fn(|cx| Pin::new(&mut signals).poll_next(cx));
        tokio::select! {
            () = &mut serving => return,
            signal = next, if listening => match signal {
                Some(Signal::Reload) => reloads.notify_one(),
                Some(Signal::Shutdown) | None => {
                    // A stream may not be polled past its end.
                    listening = signal.is_some();
                    if let Some(stop) = stop.take() {
                        let _ = stop.send(());
                    }
                }
            },
        }
    }
}

/// What a reload re-reads, and where it applies it.
struct Reloadable {
    app: Arc<App>,
    certificates: Option<Arc<Certificates>>,
    source: ConfigSource,
}

/// One reload at a time, in a task of its own, aborted once the server has drained.
async fn reload_when_asked(reloadable: Reloadable, asked: Arc<Notify>) {
    loop {
        asked.notified().await;
        reloadable.reload().await;
    }
}

impl Reloadable {
    /// The configuration file, and the listener's certificate and key, and
    /// the encryption keys: any that fails keeps what is in use, and none
    /// depends on another (a rotated certificate is applied even while the
    /// file has an error).
    async fn reload(&self) {
        let ConfigSource { path, overrides } = self.source.clone();
        // Off the async workers, since reading the file blocks; and in a task of
        // its own, so that even a bug that panics while loading fails this one
        // reload, not the loop that serves the next.
        let loaded = off_the_workers(move || Config::load(path.as_deref(), &overrides)).await;
        match loaded {
            Ok(Ok(new)) => self.app.reload(&new),
            Ok(Err(e)) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the current configuration")
            }
            Err(e) => {
                tracing::error!(error = %e, "configuration reload failed; keeping the current configuration")
            }
        }
        if let Some(certificates) = &self.certificates {
            reload_certificate(certificates.clone()).await;
        }
        reload_keys(self.app.clone()).await;
    }
}

/// How long a reload waits for its files to be read. The files are regular
/// files, opened without blocking (`store::files`), so only a mount that
/// stopped answering takes this long; the reload then keeps what is in use
/// and the next one is not held up behind it.
pub(crate) const RELOAD_READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `read` off the async workers, within [`RELOAD_READ_DEADLINE`]; `Err`
/// says why there is no answer (it panicked, or is still reading).
async fn off_the_workers<T: Send + 'static>(
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    match tokio::time::timeout(RELOAD_READ_DEADLINE, tokio::task::spawn_blocking(read)).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "its files were still being read after {RELOAD_READ_DEADLINE:?} (a mount that stopped answering?)"
        )),
    }
}

/// Re-reads the encryption key file, when records are sealed (off the async
/// workers); a failure keeps the keys in use. Only key ids are logged.
async fn reload_keys(app: Arc<App>) {
    if app.store.sealing().is_none() {
        return;
    }
    let reloaded = off_the_workers(move || app.store.sealing().map(seal::Sealing::reload)).await;
    match reloaded {
        Ok(Some(Ok(keys))) => {
            let ids: Vec<&str> = keys.ids().collect();
            tracing::info!(
                sealing_key_id = keys.sealing_id(),
                key_ids = %ids.join(","),
                "encryption keys reloaded"
            )
        }
        Ok(None) => {}
        Ok(Some(Err(e))) => {
            tracing::error!(error = %e, "encryption key reload failed; keeping the current keys")
        }
        Err(e) => {
            tracing::error!(error = %e, "encryption key reload failed; keeping the current keys")
        }
    }
}

/// Re-reads the certificate and key files (off the async workers); a failure
/// keeps the current certificate (false). Open connections are never touched: only
/// handshakes after the swap present the new certificate.
pub async fn reload_certificate(certificates: Arc<Certificates>) -> bool {
    let files = certificates.files().clone();
    let reloaded = off_the_workers(move || certificates.reload()).await;
    let (cert, key) = (files.cert_file.display(), files.key_file.display());
    match reloaded {
        Ok(Ok(())) => {
            tracing::info!(%cert, %key, "TLS certificate reloaded");
            return true;
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "TLS certificate reload failed; keeping the current certificate")
        }
        Err(e) => {
            tracing::error!(error = %e, "TLS certificate reload failed; keeping the current certificate")
        }
    }
    false
}

/// The proxy's [`ProcessSignals`].
pub fn process_signals() -> ProcessSignals {
    ProcessSignals::install("cannot listen for SIGHUP; configuration reload is off")
}

/// The process's signals as [`Signal`]s: SIGHUP a reload, SIGTERM or SIGINT a
/// shutdown, logged as it comes; later ones are caught and ignored (the
/// drain is under way). The stream never ends.
pub struct ProcessSignals {
    hangup: Option<unix::Signal>,
    /// `None` once one has come, or when a handler could not be installed.
    shutdown: Option<(unix::Signal, unix::Signal)>,
}

impl ProcessSignals {
    /// Installs the handlers (in a runtime). Without SIGHUP's, `no_reload` is
    /// logged and no reload comes; without SIGTERM's or SIGINT's, no
    /// shutdown comes: Ctrl-C still ends the process, non-gracefully.
    pub fn install(no_reload: &str) -> ProcessSignals {
        let hangup = unix::signal(SignalKind::hangup()).ok();
        if hangup.is_none() {
            tracing::warn!("{no_reload}");
        }
        let terminate = unix::signal(SignalKind::terminate());
        let interrupt = unix::signal(SignalKind::interrupt());
        ProcessSignals {
            hangup,
            shutdown: terminate.ok().zip(interrupt.ok()),
        }
    }
}

impl Stream for ProcessSignals {
    type Item = Signal;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Signal>> {
        if let Some((terminate, interrupt)) = &mut self.shutdown {
            let came = if terminate.poll_recv(cx).is_ready() {
                tracing::info!("SIGTERM received");
                true
            } else if interrupt.poll_recv(cx).is_ready() {
                tracing::info!("SIGINT received");
                true
            } else {
                false
            };
            if came {
                self.shutdown = None;
                return Poll::Ready(Some(Signal::Shutdown));
            }
        }
        if let Some(hangup) = &mut self.hangup {
            match hangup.poll_recv(cx) {
                Poll::Ready(Some(())) => return Poll::Ready(Some(Signal::Reload)),
                // The signal driver is gone: no more reloads.
                Poll::Ready(None) => self.hangup = None,
                Poll::Pending => {}
            }
        }
        Poll::Pending
    }
}
