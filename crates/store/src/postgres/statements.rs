//! The PostgreSQL store's statements, with the table's name spelt in: one
//! per operation, each a single round trip.

/// Milliseconds left until `expires_at`, on the server's clock, at least 0.
const MS_LEFT: &str = "greatest(0, ceil(extract(epoch from expires_at - now()) * 1000))::bigint";

/// The statements, with the table's name spelt in.
pub(super) struct Statements {
    pub(super) reserve: String,
    pub(super) complete: String,
    pub(super) renew: String,
    pub(super) release: String,
    pub(super) take_over: String,
    pub(super) pttl: String,
    pub(super) first: String,
    pub(super) piece: String,
    pub(super) check: String,
    pub(super) delete: String,
    pub(super) ping: String,
    pub(super) sweep: String,
}

impl Statements {
    pub(super) fn new(t: &str) -> Statements {
        Statements {
            reserve: reserve(t),
            complete: complete(t),
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3::bigint * interval '1 millisecond' \
                 WHERE key = $1::text AND token = $2::bytea AND NOT finished AND expires_at > now()"
            ),
            release: format!(
                "DELETE FROM {t} \
                 WHERE key = $1::text AND token = $2::bytea AND NOT finished AND expires_at > now()"
            ),
            // A vanished owner's reservation whose lease ran out: no more
            // than its afterlife ($7) left, on the server's clock. A row
            // that holds the taker's token already was taken by this same
            // statement, sent twice (the outer read sees the row as it was
            // before the update).
            take_over: format!(
                "WITH up AS (UPDATE {t} SET value = $2::bytea, token = $3::bytea, \
                   finished = $4::boolean, expires_at = now() + $5::bigint * interval '1 millisecond' \
                   WHERE key = $1::text AND token = $6::bytea AND NOT finished AND expires_at > now() \
                     AND expires_at <= now() + $7::bigint * interval '1 millisecond' \
                   RETURNING 1) \
                 SELECT EXISTS (SELECT 1 FROM up) \
                   OR EXISTS (SELECT 1 FROM {t} WHERE key = $1::text AND token = $3::bytea \
                     AND expires_at > now())"
            ),
            pttl: format!("SELECT {MS_LEFT} FROM {t} WHERE key = $1::text AND expires_at > now()"),
            first: format!(
                "SELECT octet_length(value)::bigint, {MS_LEFT}, substring(value from 1 for $2::int) \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            piece: format!(
                "SELECT substring(value from $2::int for $3::int) \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            check: format!(
                "SELECT octet_length(value)::bigint, token \
                 FROM {t} WHERE key = $1::text AND expires_at > now()"
            ),
            delete: format!("DELETE FROM {t} WHERE key = $1::text RETURNING expires_at > now()"),
            // Writable (not a standby, not read-only by default), and the table there.
            ping: format!(
                "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' \
                 FROM (SELECT 1) one LEFT JOIN (SELECT 1 FROM {t} LIMIT 0) t ON true"
            ),
            // Rows another proxy is deleting are skipped, not waited for.
            sweep: format!(
                "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE expires_at <= now() \
                 LIMIT $1::bigint FOR UPDATE SKIP LOCKED) AND expires_at <= now()"
            ),
        }
    }
}

/// The lease's end, `$4` milliseconds from now on the server's clock.
const LEASE: &str = "now() + $4::bigint * interval '1 millisecond'";

/// The reserve: inserts the row, or takes over an expired one, or returns
/// what holds the key.
fn reserve(t: &str) -> String {
    // `cur` reads the key (a snapshot); the insert runs only when no
    // live row is there, and takes over an expired one. A live row
    // that appeared after the snapshot makes the insert do nothing
    // and `cur` show nothing: no row back, and the caller sends the
    // reserve again (it then sees that row).
    format!(
        "WITH cur AS (SELECT value, expires_at FROM {t} WHERE key = $1::text), \
         ins AS (INSERT INTO {t} AS r (key, value, token, finished, expires_at) \
           SELECT $1::text, $2::bytea, $3::bytea, false, {LEASE} \
           WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.expires_at > now()) \
           ON CONFLICT (key) DO UPDATE SET value = excluded.value, token = excluded.token, \
             finished = false, expires_at = excluded.expires_at \
           WHERE r.expires_at <= now() \
           RETURNING 1) \
         SELECT true, NULL::bytea, 0::bigint, 0::bigint FROM ins \
         UNION ALL \
         SELECT false, substring(value from 1 for $5::int), octet_length(value)::bigint, {MS_LEFT} \
           FROM cur WHERE expires_at > now()"
    )
}

/// The completion: writes the record where the key is free, expired or
/// our own reservation.
fn complete(t: &str) -> String {
    // The completion writes whenever it conflicts (the same outcome
    // either way, so that `RETURNING` tells the truth of the row now);
    // it changes the row only when the key is free, expired, or our own
    // reservation. A finished record of ours is final.
    let ours_to_write = "(r.expires_at <= now() OR (r.token = excluded.token AND NOT r.finished))";
    let keep = |col: &str| {
        format!("{col} = CASE WHEN {ours_to_write} THEN excluded.{col} ELSE r.{col} END")
    };
    format!(
        "WITH cur AS (SELECT token, expires_at > now() AS live FROM {t} WHERE key = $1::text), \
         up AS (INSERT INTO {t} AS r (key, value, token, finished, expires_at) \
           VALUES ($1::text, $2::bytea, $3::bytea, true, {LEASE}) \
           ON CONFLICT (key) DO UPDATE SET {}, {}, {}, {} \
           RETURNING r.token = $3::bytea AS ours) \
         SELECT ours, coalesce((SELECT live AND token = $3::bytea FROM cur), false) FROM up",
        keep("value"),
        keep("token"),
        keep("finished"),
        keep("expires_at"),
    )
}
