//! `[store]`: the backend, its URL and TLS mode, the PostgreSQL table's
//! name, the Redis key prefix and topology.

use std::path::PathBuf;
use std::time::Duration;

use toml::Spanned;

use super::{duration, Given};
use crate::config::raw::RawStore;
use crate::config::{Backend, ConfigError, Overrides, RedisMode, Source, SslMode, StoreConfig};

pub(super) fn store(s: RawStore, src: &Source, ov: &Overrides) -> Result<StoreConfig, ConfigError> {
    let backend = if ov.redis_url.is_some() {
        Backend::Redis
    } else {
        s.backend.unwrap_or(Backend::Memory)
    };
    if backend == Backend::Redis {
        check_topology(&s, src)?;
    }
    let default_url = match backend {
        Backend::Postgres => "postgres://idemproxy@127.0.0.1:5432/idemproxy",
        _ => "redis://127.0.0.1:6379/0",
    };
    let url = Given::or_default(
        Given::pick(Overrides::REDIS_URL, &ov.redis_url, s.url),
        default_url,
    );
    let scheme_ok = url.value.starts_with("redis://") || url.value.starts_with("rediss://");
    if backend == Backend::Redis && !scheme_ok {
        // The URL itself is not repeated: it may hold a password.
        return Err(src.given(
            &url.origin,
            "store.url",
            "invalid Redis URL: expected redis:// or rediss://",
        ));
    }
    let standalone = s
        .mode
        .as_ref()
        .is_none_or(|m| *m.get_ref() == RedisMode::Standalone);
    if backend == Backend::Redis && standalone {
        // As the store reads it at start (a database that is not a number,
        // a port out of range): exit 2 from --check, not 1 from the start.
        if let Err(e) = idemproxy_store::config::check_redis_url(&url.value) {
            return Err(src.given(&url.origin, "store.url", format!("invalid Redis URL: {e}")));
        }
    }
    if backend == Backend::Redis {
        for (key, list) in [("store.nodes", &s.nodes), ("store.sentinels", &s.sentinels)] {
            let Some(list) = list else { continue };
            for (i, entry) in list.get_ref().iter().enumerate() {
                if let Err(e) = idemproxy_store::config::check_redis_url(entry) {
                    return Err(src.entry(
                        &list.span(),
                        key,
                        format!("entry {}: invalid Redis URL: {e}", i + 1),
                    ));
                }
            }
        }
    }
    if backend == Backend::Postgres {
        postgres_url(&url, src)?;
    }
    let sslmode_span = s.sslmode.as_ref().map(Spanned::span);
    let sslmode = sslmode(s.sslmode, src)?;
    if let Some(span) = sslmode_span.filter(|_| sslmode.required()) {
        if backend == Backend::Postgres && s.tls_ca_file.is_none() {
            return Err(src.entry(
                &span,
                "store.sslmode",
                "this sslmode needs TLS: name the CA that signed the server's certificate in tls_ca_file",
            ));
        }
    }
    if backend == Backend::Postgres {
        url_sslmode(&url, sslmode, src)?;
    }
    let table = table(s.table, src)?;
    let pool_size = match s.pool_size {
        Some(n) if *n.get_ref() == 0 => {
            return Err(src.entry(&n.span(), "store.pool_size", "must be at least 1"))
        }
        Some(n) => n.into_inner() as usize,
        None => 16,
    };
    let key_prefix = key_prefix(s.key_prefix, src)?;
    let require_sealed = require_sealed(&s.encryption_key_file, &s.require_sealed, src)?;
    Ok(StoreConfig {
        backend,
        url: url.value,
        key_prefix: key_prefix.value,
        op_timeout: duration(s.op_timeout, Duration::from_millis(500)),
        password_file: s.password_file,
        mode: s.mode.map_or(RedisMode::Standalone, Spanned::into_inner),
        nodes: s.nodes.map(Spanned::into_inner).unwrap_or_default(),
        sentinels: s.sentinels.map(Spanned::into_inner).unwrap_or_default(),
        master_name: s.master_name,
        username: s.username,
        tls_ca_file: s.tls_ca_file,
        wait_replicas: s.wait_replicas.unwrap_or(0),
        wait_timeout: duration(s.wait_timeout, Duration::from_millis(50)),
        memory_limit: s.memory_limit.map_or(256 << 20, |b| b.0),
        encryption_key_file: s.encryption_key_file.map(Spanned::into_inner),
        require_sealed,
        sslmode,
        table,
        pool_size,
    })
}

/// A PostgreSQL URL that the client can read (`postgres://` or
/// `postgresql://`, one host or several). The URL is not repeated in the
/// message: it may hold a password.
fn postgres_url(url: &Given, src: &Source) -> Result<(), ConfigError> {
    let scheme_ok = url.value.starts_with("postgres://") || url.value.starts_with("postgresql://");
    if !scheme_ok {
        return Err(src.given(
            &url.origin,
            "store.url",
            "invalid PostgreSQL URL: expected postgres:// or postgresql://",
        ));
    }
    if let Err(e) = url.value.parse::<tokio_postgres::Config>() {
        return Err(src.given(
            &url.origin,
            "store.url",
            format!("invalid PostgreSQL URL: {e}"),
        ));
    }
    Ok(())
}

/// An `sslmode` in the URL must say what `store.sslmode` says: the proxy
/// sets the client's TLS mode from `store.sslmode` (with `tls_ca_file`), so
/// a URL's `sslmode=require` would otherwise be overridden without a word,
/// and a connection meant to be encrypted made in plain text.
fn url_sslmode(url: &Given, sslmode: SslMode, src: &Source) -> Result<(), ConfigError> {
    let query = url.value.split_once('?').map_or("", |(_, q)| q);
    let query = query.split('#').next().unwrap_or("");
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == "sslmode" && value != sslmode.name() {
            return Err(src.given(
                &url.origin,
                "store.url",
                format!(
                    "the URL says sslmode={value} but store.sslmode is \"{}\": the proxy's TLS \
                     follows store.sslmode (with tls_ca_file); set it there and leave sslmode \
                     out of the URL",
                    sslmode.name()
                ),
            ));
        }
    }
    Ok(())
}

fn sslmode(given: Option<Spanned<String>>, src: &Source) -> Result<SslMode, ConfigError> {
    match given {
        None => Ok(SslMode::Prefer),
        Some(s) => SslMode::parse(s.get_ref()).ok_or_else(|| {
            src.entry(
                &s.span(),
                "store.sslmode",
                format!(
                    "unknown sslmode \"{}\": one of {}",
                    s.get_ref(),
                    SslMode::NAMES.join(", ")
                ),
            )
        }),
    }
}

/// PostgreSQL's reserved key words (`pg_get_keywords()`, categories `R`
/// and `T`, in PostgreSQL 15, with 16's `system_user`): none can name a
/// table unquoted.
const RESERVED: &str = "\
    all analyse analyze and any array as asc asymmetric authorization binary \
    both case cast check collate collation column concurrently constraint \
    create cross current_catalog current_date current_role current_schema \
    current_time current_timestamp current_user default deferrable desc \
    distinct do else end except false fetch for foreign freeze from full grant \
    group having ilike in initially inner intersect into is isnull join lateral \
    leading left like limit localtime localtimestamp natural not notnull null \
    offset on only or order outer overlaps placing primary references returning \
    right select session_user similar some symmetric system_user table \
    tablesample then to trailing true union unique user using variadic verbose \
    when where window with";

/// The records' table: a plain lower-case SQL identifier (it is spelt into
/// every statement unquoted), not a reserved key word, at most 50 bytes so
/// that its index's name fits.
fn table(given: Option<Spanned<String>>, src: &Source) -> Result<String, ConfigError> {
    let Some(t) = given else {
        return Ok("idemproxy_records".to_string());
    };
    let name = t.get_ref();
    let ok = !name.is_empty()
        && name.len() <= 50
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(src.entry(
            &t.span(),
            "store.table",
            format!(
                "invalid table name \"{name}\": a lower-case identifier (a-z, 0-9, _; not starting with a digit), at most 50 bytes"
            ),
        ));
    }
    if RESERVED.split_whitespace().any(|w| w == name) {
        return Err(src.entry(
            &t.span(),
            "store.table",
            format!("invalid table name \"{name}\": a key word PostgreSQL reserves"),
        ));
    }
    Ok(t.into_inner())
}

/// The prefix of every key the proxy writes: visible ASCII without spaces,
/// not empty (it is spelt into Redis keys, and shared stores tell proxies apart by it).
fn key_prefix(given: Option<Spanned<String>>, src: &Source) -> Result<Given, ConfigError> {
    let key_prefix = Given::or_default(Given::file(given), "idemproxy");
    let prefix = &key_prefix.value;
    if prefix.is_empty() || prefix.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        return Err(src.given(
            &key_prefix.origin,
            "store.key_prefix",
            format!("invalid key prefix \"{prefix}\": visible ASCII without spaces, not empty"),
        ));
    }
    Ok(key_prefix)
}

/// Sealing's settings, checked together: a key file named by an empty path
/// is a mistake, not "no key"; `require_sealed = true` means nothing without
/// a key to seal and open records with. Whether sealing is required.
fn require_sealed(
    key_file: &Option<Spanned<PathBuf>>,
    required: &Option<Spanned<bool>>,
    src: &Source,
) -> Result<bool, ConfigError> {
    if let Some(p) = key_file
        .as_ref()
        .filter(|p| p.get_ref().as_os_str().is_empty())
    {
        return Err(src.entry(
            &p.span(),
            "store.encryption_key_file",
            "an empty path: name the key file",
        ));
    }
    let require_sealed = required.as_ref().is_some_and(|r| *r.get_ref());
    if let Some(r) = required.as_ref().filter(|_| require_sealed) {
        if key_file.is_none() {
            return Err(src.entry(
                &r.span(),
                "store.require_sealed",
                "require_sealed = true needs an encryption_key_file to seal and open records",
            ));
        }
    }
    Ok(require_sealed)
}

/// Cluster and sentinel modes need their seed addresses. The error points at
/// the empty list when there is one, else at the `mode` that asks for it.
fn check_topology(s: &RawStore, src: &Source) -> Result<(), ConfigError> {
    let Some(mode) = &s.mode else {
        return Ok(());
    };
    let empty =
        |list: &Option<Spanned<Vec<String>>>| list.as_ref().is_none_or(|l| l.get_ref().is_empty());
    let at = |list: &Option<Spanned<Vec<String>>>| list.as_ref().map_or(mode.span(), |l| l.span());
    match mode.get_ref() {
        RedisMode::Standalone => Ok(()),
        RedisMode::Cluster if empty(&s.nodes) => Err(src.invalid(
            at(&s.nodes).start,
            "store.nodes",
            "mode = \"cluster\" needs at least one seed node",
        )),
        RedisMode::Sentinel if empty(&s.sentinels) || s.master_name.is_none() => {
            let key = if empty(&s.sentinels) {
                "store.sentinels"
            } else {
                "store.master_name"
            };
            Err(src.invalid(
                at(&s.sentinels).start,
                key,
                "mode = \"sentinel\" needs `sentinels` and `master_name`",
            ))
        }
        RedisMode::Cluster | RedisMode::Sentinel => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::RESERVED;

    #[test]
    fn the_reserved_key_words_are_postgresql_15s_and_system_user() {
        let words: Vec<&str> = RESERVED.split_whitespace().collect();
        assert_eq!(words.len(), 101);
        assert!(words.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
        for word in ["user", "order", "select", "system_user", "with", "all"] {
            assert!(words.contains(&word), "{word}");
        }
        // Column-name key words name a table unquoted: allowed.
        for word in ["values", "time", "between", "idemproxy_records"] {
            assert!(!words.contains(&word), "{word}");
        }
    }
}
