//! The checked build: the file as written plus the overrides → a typed [`Config`], or the first error with its place.

mod routes;
mod server;
mod store;
pub(super) mod telemetry;

use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;

use super::grammar::HumanDuration;
use super::raw::RawFile;
use super::{Config, ConfigError, Flag, Origin, Overrides, Source};

pub(super) use self::telemetry::telemetry;

pub(super) fn build(raw: RawFile, src: &Source, ov: &Overrides) -> Result<Config, ConfigError> {
    let server = server::server(raw.server, src, ov)?;
    let store = store::store(raw.store, src, ov)?;
    let routes = routes::routes(&raw.defaults, &raw.routes, src)?;
    routes::within_budget(&server, &raw.defaults, &raw.routes, &routes, src)?;
    let telemetry = telemetry(raw.telemetry, src, &|var| std::env::var(var).ok())?;
    Ok(Config {
        source: src.file.to_string(),
        server,
        store,
        routes: Arc::new(routes),
        telemetry,
    })
}

/// A text value that is checked after parsing, with where it came from.
struct Given {
    value: String,
    origin: Origin,
}

impl Given {
    /// The override wins over the file.
    fn pick(flag: Flag, over: &Option<String>, file: Option<Spanned<String>>) -> Option<Given> {
        match over {
            Some(value) => Some(Given {
                value: value.clone(),
                origin: Origin::Flag(flag),
            }),
            None => Given::file(file),
        }
    }

    fn file(file: Option<Spanned<String>>) -> Option<Given> {
        file.map(|v| Given {
            origin: Origin::File(v.span()),
            value: v.into_inner(),
        })
    }

    fn or_default(given: Option<Given>, default: &str) -> Given {
        given.unwrap_or_else(|| Given {
            value: default.to_string(),
            origin: Origin::Default,
        })
    }
}

fn duration(value: Option<HumanDuration>, default: Duration) -> Duration {
    value.map_or(default, |d| d.0)
}
