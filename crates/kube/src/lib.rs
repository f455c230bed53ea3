//! Adding the idemproxy sidecar to Kubernetes workloads that exist: `idemproxy inject` and the injector webhook.
//!
//! One change, made by [`pod::inject_pod`]: the port to protect is chosen
//! (`--port`, the `idemproxy.dev/port` annotation, the port a Service
//! targets, the only port), and a native sidecar (an init container with
//! `restartPolicy: Always`) takes over that port's name on a port of its
//! own, forwarding to the application over loopback. [`manifests`] applies
//! it to a stream of manifests and rewires the Services; [`webhook`] applies
//! it to one Pod and answers with the JSON patch.

#![forbid(unsafe_code)]

use std::fmt;

mod documents;
mod error;
// Serving until SIGTERM, the certificate re-read on SIGHUP and when it changes.
pub mod lifecycle;
// YAML out for YAML 1.1 readers; `openapi` writes documents with it too.
mod image;
pub mod manifests;
pub mod pod;
pub mod ports;
pub mod select;
mod services;
pub mod webhook;

pub use image::check_image;
pub use manifests::{inject_manifests, Injected, ManifestError, Options};
pub use pod::{inject_pod, Change, FieldError, Injection};
pub use ports::ServicePort;
pub use select::Selection;

/// The image the sidecar runs by default: the one the release workflow publishes for this version.
pub const DEFAULT_IMAGE: &str = concat!("ghcr.io/idemproxy/idemproxy:", env!("CARGO_PKG_VERSION"));
/// The ConfigMap the sidecar reads its configuration from by default.
pub const DEFAULT_CONFIG_MAP: &str = "idemproxy-config";
/// The admin port when no configuration file says it (the shipped ConfigMap's `admin_listen`).
pub const DEFAULT_ADMIN_PORT: u16 = 9901;

/// What every injection shares.
#[derive(Clone, Debug)]
pub struct Settings {
    pub image: String,
    pub config_map: String,
    /// `--port`: the port to protect in every workload, by name or number.
    pub port: Option<PortRef>,
    /// The proxy's admin port (probes), from the configuration's `admin_listen`.
    pub admin_port: u16,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            image: DEFAULT_IMAGE.into(),
            config_map: DEFAULT_CONFIG_MAP.into(),
            port: None,
            admin_port: DEFAULT_ADMIN_PORT,
        }
    }
}

/// A port as Kubernetes refers to one: by number or by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

impl PortRef {
    /// All digits and within range → a number; anything else → a name.
    pub fn parse(text: &str) -> PortRef {
        match text.parse::<u16>() {
            Ok(n) => PortRef::Number(n),
            Err(_) => PortRef::Name(text.to_owned()),
        }
    }
}

impl fmt::Display for PortRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(n) => f.write_str(n),
        }
    }
}
