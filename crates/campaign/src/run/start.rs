//! Starting a campaign: its settings (binary, route, lease), its output
//! directory, the upstream behind its relay, the proxies, and the `Run` line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Options;
use crate::clients;
use crate::history::{AtRisk, Run};
use crate::procs::{free_port, Proc};
use crate::relay::{Owners, Relay};
use crate::rng::Rng;

/// What the options and the route file settle before anything starts.
pub(super) struct Settings {
    pub(super) binary: PathBuf,
    pub(super) route: toml::Table,
    pub(super) lease: Duration,
    pub(super) lease_expiry: String,
}

impl Settings {
    pub(super) fn read(opts: &Options) -> Result<Settings, String> {
        let binary = idemproxy_binary(opts.idemproxy.as_deref())?;
        let route = route_settings(opts.proxy_config_extra.as_deref())?;
        let lease = match route.get("lease") {
            Some(toml::Value::String(text)) => crate::parse_duration(text)?,
            Some(other) => {
                return Err(format!(
                    "lease = {other}: a duration is written as a string, e.g. lease = \"1s\""
                ))
            }
            None => Duration::from_secs(2),
        };
        if opts.duration < Duration::from_secs(5) {
            return Err(
                "--duration must be at least 5s (the clients and the nemesis need time to run)"
                    .into(),
            );
        }
        let lease_expiry = route
            .get("lease_expiry")
            .and_then(|v| v.as_str())
            .unwrap_or("unknown_outcome")
            .to_string();
        Ok(Settings {
            binary,
            route,
            lease,
            lease_expiry,
        })
    }
}

/// Makes `out` the run's directory (only a new or a campaign's own: it
/// replaces what an earlier run left there); returns its `logs`.
pub(super) fn prepare_out(out: &Path) -> Result<PathBuf, String> {
    let marker = out.join(".campaign-out");
    let used = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if used && !marker.exists() {
        return Err(format!(
            "--out {}: not empty and not a campaign's output; give a new directory",
            out.display()
        ));
    }
    std::fs::create_dir_all(out.join("logs")).map_err(|e| format!("{}: {e}", out.display()))?;
    std::fs::write(
        &marker,
        "written by campaign; a later run may replace this directory's contents\n",
    )
    .map_err(|e| format!("{}: {e}", marker.display()))?;
    std::fs::canonicalize(out.join("logs")).map_err(|e| e.to_string())
}

/// The upstream process, its port and the relay in front of it.
pub(super) struct Upstream {
    pub(super) proc: Proc,
    pub(super) port: u16,
    pub(super) relay: Relay,
}

/// Starts the upstream (journaling to `journal`) and its relay.
pub(super) async fn upstream(
    logs: &Path,
    journal: &Path,
    owners: &Arc<Owners>,
    rng: &Rng,
) -> Result<Upstream, String> {
    let _ = std::fs::remove_file(journal);
    let upstream_port = free_port();
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let j = journal.to_path_buf();
    let upstream = Proc::start(
        "upstream",
        logs.join("upstream.log"),
        Box::new(move || {
            let mut c = Command::new(&me);
            c.args([
                "upstream",
                "--port",
                &upstream_port.to_string(),
                "--journal",
            ])
            .arg(&j);
            c
        }),
    )
    .map_err(|e| format!("the upstream: {e}"))?;
    wait_http(
        &format!("http://127.0.0.1:{upstream_port}/healthz"),
        Duration::from_secs(20),
    )
    .await?;
    let upstream_relay = Relay::start(
        SocketAddr::from(([127, 0, 0, 1], upstream_port)),
        owners.clone(),
        rng.fork(1),
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(Upstream {
        proc: upstream,
        port: upstream_port,
        relay: upstream_relay,
    })
}

/// Starts the proxies and waits until each is ready; returns them and the
/// addresses the clients use.
pub(super) async fn proxies(
    opts: &Options,
    settings: &Settings,
    logs: &Path,
    upstream: SocketAddr,
    store_toml: &str,
) -> Result<(Vec<Proc>, Vec<SocketAddr>), String> {
    let binary = &settings.binary;
    let mut proxies = Vec::new();
    let mut proxy_addrs = Vec::new();
    let mut admins = Vec::new();
    for i in 0..opts.proxies {
        let ports = (free_port(), free_port());
        let config = logs.join(format!("proxy-{i}.toml"));
        std::fs::write(
            &config,
            proxy_config(i, ports, upstream, store_toml, &settings.route),
        )
        .map_err(|e| e.to_string())?;
        let bin = binary.clone();
        let p = Proc::start(
            &format!("proxy-{i}"),
            logs.join(format!("proxy-{i}.log")),
            Box::new(move || {
                let mut c = Command::new(&bin);
                c.arg("--config").arg(&config).env("RUST_LOG", "warn");
                c
            }),
        )
        .map_err(|e| format!("{}: {e}", binary.display()))?;
        proxies.push(p);
        proxy_addrs.push(SocketAddr::from(([127, 0, 0, 1], ports.0)));
        admins.push(ports.1);
    }
    for (i, a) in admins.iter().enumerate() {
        wait_http(
            &format!("http://127.0.0.1:{a}/readyz"),
            Duration::from_secs(60),
        )
        .await
        .map_err(|e| {
            format!(
                "proxy-{i} is not ready ({e}); its log: {}",
                logs.join(format!("proxy-{i}.log")).display()
            )
        })?;
    }
    Ok((proxies, proxy_addrs))
}

/// The history's `Run` line.
pub(super) fn run_line(opts: &Options, settings: &Settings, settle_bound: Duration) -> Run {
    Run {
        topology: opts.topology.name().into(),
        seed: opts.seed,
        duration_ms: opts.duration.as_millis() as u64,
        proxies: opts.proxies,
        clients: opts.clients,
        lease_ms: settings.lease.as_millis() as u64,
        lease_expiry: settings.lease_expiry.clone(),
        wait_replicas: opts.topology.wait_replicas(),
        at_risk: if opts.topology.asynchronous() {
            AtRisk::StoreFailover
        } else {
            AtRisk::Never
        },
        settle_bound_ms: settle_bound.as_millis() as u64,
    }
}

/// The route's settings: the campaign's defaults, then the user's file.
fn route_settings(extra: Option<&Path>) -> Result<toml::Table, String> {
    let mut table: toml::Table = toml::from_str("lease = \"2s\"\nttl = \"1h\"\n").unwrap();
    if let Some(path) = extra {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let more: toml::Table = toml::from_str(&text)
            .map_err(|e| format!("{}: not TOML route settings: {e}", path.display()))?;
        for (k, v) in more {
            if ["path", "name", "methods"].contains(&k.as_str()) {
                return Err(format!(
                    "{}: `{k}` is the campaign's own; give route settings only (lease, ttl, lease_expiry...)",
                    path.display()
                ));
            }
            table.insert(k, v);
        }
    }
    Ok(table)
}

fn proxy_config(
    i: u32,
    ports: (u16, u16),
    upstream: SocketAddr,
    store: &str,
    route: &toml::Table,
) -> String {
    let mut lines = String::new();
    for (k, v) in route {
        lines.push_str(&format!("{k} = {v}\n"));
    }
    format!(
        "# proxy-{i}, written by the campaign\n[server]\nlisten = \"127.0.0.1:{}\"\nadmin_listen = \"127.0.0.1:{}\"\n\
         upstream = \"http://{upstream}\"\nupstream_timeout = \"10s\"\nshutdown_grace = \"1s\"\n\n\
         [store]\n{store}\n[[routes]]\nname = \"pay\"\npath = \"/pay\"\nmethods = [\"POST\"]\n{lines}",
        ports.0, ports.1
    )
}

async fn wait_http(url: &str, within: Duration) -> Result<(), String> {
    let http = clients::http();
    let until = Instant::now() + within;
    loop {
        let req = hyper::Request::get(url)
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(1), http.request(req)).await {
            if r.status() == 200 {
                return Ok(());
            }
        }
        if Instant::now() > until {
            return Err(format!("{url} did not answer 200 within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn idemproxy_binary(given: Option<&Path>) -> Result<PathBuf, String> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("idemproxy"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no idemproxy binary at {} (build both: cargo build --release --workspace; or give --idemproxy)",
            path.display()
        ))
    }
}
