//! The PostgreSQL store's own behaviour: the table is explicit (`--init-store`,
//! the start-up check), expired rows are never served and are swept in
//! batches, and store faults (the server gone, a statement that cannot
//! finish in `op_timeout`) are handled as on Redis. The scenarios every
//! store shares run on PostgreSQL through `on_every_backend!`.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use support::*;

/// The binary run to its end: its exit code and output are what is tested.
fn idemproxy(config: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .env_remove("IDEMPROXY_CONFIG")
        .env_remove("IDEMPROXY_REDIS_URL")
        .env_remove("IDEMPROXY_POSTGRES_PASSWORD")
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("run idemproxy")
}

fn assert_exit(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    stderr
}

fn config_file(dir: &std::path::Path, store: &str) -> std::path::PathBuf {
    let path = dir.join("idemproxy.toml");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:1\"\n[store]\n{store}\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_stops_the_start_and_init_store_creates_it_once() {
    let pg = PgServer::start().await;
    pg.drop_table().await;
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(
        dir.path(),
        &format!("backend = \"postgres\"\nurl = \"{}\"", pg.url()),
    );
    // `--check` does not contact the store.
    assert_exit(&idemproxy(&config, &["--check"]), 0);
    // No table: exit 1, naming what to run; nothing is created.
    let stderr = assert_exit(&idemproxy(&config, &[]), 1);
    assert!(
        stderr.contains("--init-store") && stderr.contains("deploy/postgres/schema.sql"),
        "{stderr}"
    );
    assert!(pg
        .query("SELECT to_regclass('idemproxy_records')::text")
        .await[0]
        .get::<_, Option<String>>(0)
        .is_none());
    // Created, then again: nothing to do, the same answer.
    for _ in 0..2 {
        let out = idemproxy(&config, &["--init-store"]);
        assert_exit(&out, 0);
        assert!(String::from_utf8_lossy(&out.stdout).contains("is ready"));
    }
    assert_eq!(pg.keys().await.len(), 0);
    let admin = pg.client().await;
    // Again on a live table (a transaction holds the lock every write takes):
    // nothing is run, so nothing waits for a lock.
    admin
        .batch_execute("BEGIN; LOCK TABLE idemproxy_records IN ROW EXCLUSIVE MODE")
        .await
        .unwrap();
    let out = idemproxy(&config, &["--init-store"]);
    assert_exit(&out, 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing was changed"));
    admin.batch_execute("COMMIT").await.unwrap();
    // Other columns: fine when they may be null or have a default, wherever they are...
    admin
        .batch_execute(
            "ALTER TABLE idemproxy_records ADD COLUMN note text, \
             ADD COLUMN n int NOT NULL DEFAULT 0, ADD COLUMN must int",
        )
        .await
        .unwrap();
    assert_exit(&idemproxy(&config, &["--init-store"]), 0);
    // ...not when one must be given a value (not the first of the others).
    admin
        .batch_execute("ALTER TABLE idemproxy_records ALTER COLUMN must SET NOT NULL")
        .await
        .unwrap();
    let stderr = assert_exit(&idemproxy(&config, &["--init-store"]), 1);
    assert!(stderr.contains("\"must\""), "{stderr}");
    admin
        .batch_execute(
            "ALTER TABLE idemproxy_records DROP COLUMN must, DROP COLUMN n, DROP COLUMN note",
        )
        .await
        .unwrap();
    // An invalid key index (a failed CREATE INDEX CONCURRENTLY leaves one).
    let validity = |v: bool| {
        format!(
            "UPDATE pg_index SET indisvalid = {v} \
             WHERE indexrelid = 'idemproxy_records_pkey'::regclass"
        )
    };
    admin.batch_execute(&validity(false)).await.unwrap();
    let stderr = assert_exit(&idemproxy(&config, &["--init-store"]), 1);
    assert!(stderr.contains("no valid unique index"), "{stderr}");
    admin.batch_execute(&validity(true)).await.unwrap();
    // A deferrable key (ON CONFLICT cannot use it: every reserve would fail).
    admin
        .batch_execute(
            "ALTER TABLE idemproxy_records DROP CONSTRAINT idemproxy_records_pkey, \
             ADD PRIMARY KEY (key) DEFERRABLE INITIALLY IMMEDIATE",
        )
        .await
        .unwrap();
    let stderr = assert_exit(&idemproxy(&config, &["--init-store"]), 1);
    assert!(stderr.contains("DEFERRABLE"), "{stderr}");
    admin
        .batch_execute(
            "ALTER TABLE idemproxy_records DROP CONSTRAINT idemproxy_records_pkey, \
             ADD PRIMARY KEY (key)",
        )
        .await
        .unwrap();
    assert_exit(&idemproxy(&config, &["--init-store"]), 0);
    // ...nor a deferrable unique constraint beside the key: ON CONFLICT
    // takes it as an arbiter too.
    admin
        .batch_execute(
            "ALTER TABLE idemproxy_records ADD CONSTRAINT key_deferred UNIQUE (key) \
             DEFERRABLE INITIALLY IMMEDIATE",
        )
        .await
        .unwrap();
    let stderr = assert_exit(&idemproxy(&config, &["--init-store"]), 1);
    assert!(stderr.contains("DEFERRABLE"), "{stderr}");
    admin
        .batch_execute("ALTER TABLE idemproxy_records DROP CONSTRAINT key_deferred")
        .await
        .unwrap();
    assert_exit(&idemproxy(&config, &["--init-store"]), 0);
    // An UNLOGGED table (emptied by a crash, not replicated) stops the
    // start and `--init-store`, naming the fix.
    admin
        .batch_execute("ALTER TABLE idemproxy_records SET UNLOGGED")
        .await
        .unwrap();
    for args in [&["--init-store"][..], &[][..]] {
        let stderr = assert_exit(&idemproxy(&config, args), 1);
        assert!(
            stderr.contains("ALTER TABLE idemproxy_records SET LOGGED"),
            "{stderr}"
        );
    }
    admin
        .batch_execute("ALTER TABLE idemproxy_records SET LOGGED")
        .await
        .unwrap();
    assert_exit(&idemproxy(&config, &["--init-store"]), 0);
    // A table of another shape is not touched, and stops the start.
    pg.client()
        .await
        .batch_execute("ALTER TABLE idemproxy_records DROP COLUMN finished")
        .await
        .unwrap();
    let stderr = assert_exit(&idemproxy(&config, &["--init-store"]), 1);
    assert!(stderr.contains("\"finished\""), "{stderr}");
    let stderr = assert_exit(&idemproxy(&config, &[]), 1);
    assert!(stderr.contains("\"finished\""), "{stderr}");
}

#[test]
fn init_store_exits_1_when_the_store_is_unreachable_2_when_invalid_0_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let unreachable = config_file(
        dir.path(),
        &format!("backend = \"postgres\"\nurl = \"postgres://postgres@127.0.0.1:{port}/postgres\""),
    );
    let stderr = assert_exit(&idemproxy(&unreachable, &["--init-store"]), 1);
    assert!(stderr.contains("unreachable"), "{stderr}");
    for (bad, key) in [
        ("url = \"redis://127.0.0.1:6379\"", "store.url"),
        ("table = \"Robert'); DROP TABLE x\"", "store.table"),
        // A reserved key word cannot name a table unquoted.
        ("table = \"user\"", "store.table"),
        ("table = \"order\"", "store.table"),
        ("sslmode = \"sometimes\"", "store.sslmode"),
        ("sslmode = \"verify-full\"", "store.sslmode"),
        ("pool_size = 0", "store.pool_size"),
        // An sslmode in the URL that store.sslmode does not say: never
        // silently overridden (here: plain text where the URL asked for TLS).
        (
            "url = \"postgres://u@127.0.0.1/db?sslmode=require\"",
            "store.url",
        ),
        (
            "url = \"postgres://u@127.0.0.1/db?sslmode=disable\"\nsslmode = \"prefer\"",
            "store.url",
        ),
    ] {
        let config = config_file(dir.path(), &format!("backend = \"postgres\"\n{bad}"));
        for args in [&["--init-store"][..], &["--check"][..]] {
            let stderr = assert_exit(&idemproxy(&config, args), 2);
            assert!(stderr.contains(key), "{bad}: {stderr}");
        }
    }
    for store in ["backend = \"memory\"", "backend = \"redis\""] {
        let config = config_file(dir.path(), store);
        let out = idemproxy(&config, &["--init-store"]);
        assert_exit(&out, 0);
        assert!(String::from_utf8_lossy(&out.stdout).contains("nothing to do"));
    }
}

/// An expired row is never served (the reserve takes it over as if the key
/// were free; a read does not find it), and the sweep deletes expired rows
/// in batches, leaving live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_never_served_and_are_swept_in_batches() {
    use idemproxy::record::{Finished, Record, Token};
    use idemproxy::store::Reservation;

    let pg = PgServer::start().await;
    let text = ConfigBuilder::new("http://127.0.0.1:1")
        .postgres(&pg)
        .build();
    let cfg = idemproxy::config::Config::from_toml(&text, "t.toml", &Default::default()).unwrap();
    let metrics = std::sync::Arc::new(idemproxy::metrics::Metrics::new());
    let store = idemproxy::store::Store::new(&cfg.store, metrics, 1).unwrap();
    store.check_schema().await.unwrap();
    let key = store.key_for("expired");
    let old = Token::new();
    let finished = Record::Finished(Finished {
        token: old,
        fingerprint: [1; 32],
        created_ms: 1,
        route: "r".into(),
        trace: None,
        completed_ms: 2,
        status: 201,
        reason: None,
        body_stored: true,
        headers: vec![],
        body: bytes::Bytes::from_static(b"stale"),
        trailers: vec![],
    })
    .encode();
    // A finished record whose TTL ended a second ago, not yet swept.
    let client = pg.client().await;
    client
        .execute(
            "INSERT INTO idemproxy_records VALUES ($1, $2, $3, true, now() - interval '1 second')",
            &[&key, &&finished[..], &&old.0[..]],
        )
        .await
        .unwrap();
    assert!(
        store.get(&key).await.unwrap().is_none(),
        "an expired record was read"
    );
    assert_eq!(store.pttl(&key).await.unwrap(), Duration::ZERO);
    let mine = Token::new();
    let r = store
        .reserve(&key, processing(mine), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        matches!(r, Reservation::Reserved),
        "an expired record was served: {r:?}"
    );
    assert!(store
        .renew(&key, mine, Duration::from_secs(5))
        .await
        .unwrap());

    // 1 234 expired rows and our live one: the sweep takes the expired ones
    // in batches (500, 500, 234), each a statement of its own.
    client
        .execute(
            "INSERT INTO idemproxy_records SELECT 'idemproxy:old' || i, '\\x00', '\\x00', true, \
             now() - interval '1 minute' FROM generate_series(1, 1234) i",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(store.sweep_expired_once().await.unwrap(), 1234);
    assert_eq!(pg.keys().await, vec![key.clone()], "the live row stays");
    let rows: i64 = client
        .query_one("SELECT count(*) FROM idemproxy_records", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    assert_eq!(store.sweep_expired_once().await.unwrap(), 0);
}

/// A reservation as the request path writes it (the store only reads its token).
fn processing(token: idemproxy::record::Token) -> bytes::Bytes {
    let mut v = vec![1u8, idemproxy::record::STATE_PROCESSING];
    v.extend_from_slice(&token.0);
    v.resize(64, 0);
    bytes::Bytes::from(v)
}

const ROUTES: &str = r#"
[[routes]]
name = "payments"
path = "/v1/payments"
lease = "10s"
"#;

/// The server goes away: protected routes answer 503 (`on_store_error =
/// "reject"`) at once, and work again once it is back, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_gives_503_then_recovers_without_a_proxy_restart() {
    let mut env = Env::builder(Backend::Postgres)
        .routes(ROUTES)
        .store("op_timeout = \"300ms\"")
        .start()
        .await;
    let url = env.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-before").body("x").await.status, 201);
    env.postgres.as_mut().unwrap().kill_keeping_port();
    for _ in 0..3 {
        let r = Call::post(&url).key("k-during").body("x").await;
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    }
    env.postgres.as_mut().unwrap().restart().await;
    eventually("protected routes to work again", DEADLINE, || {
        let url = url.clone();
        async move { (Call::post(&url).key("k-after").body("x").await.status == 201).then_some(()) }
    })
    .await;
    assert!(Call::post(&url).key("k-after").body("x").await.is_replay());
    assert!(Call::post(&url).key("k-before").body("x").await.is_replay());
    assert_eq!(env.upstream.hits(), 2);
}

/// The table is locked while the upstream answers: the completion's
/// statement cannot finish within `op_timeout` (the server cancels it at its
/// `statement_timeout`), the client has its answer at once, and the
/// completion is retried in the background until the lock goes; the record
/// is stored, and a retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_times_out_is_retried_in_the_background() {
    let env = Env::builder(Backend::Postgres)
        .routes(ROUTES)
        .store("op_timeout = \"200ms\"")
        .start()
        .await;
    let pg = env.postgres.as_ref().unwrap();
    let url = env.url("/v1/payments");
    let first = Call::post(&url)
        .key("k-locked")
        .header("x-test-hold", "1")
        .spawn("x");
    env.upstream.wait_hits(1).await;
    let mut locker = pg.client().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE idemproxy_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    env.upstream.release(1);
    let r = first.await.unwrap();
    assert_eq!(
        r.status, 201,
        "answered although the completion cannot be written"
    );
    env.metric_reaching("idemproxy_store_errors_total{op=\"complete\"}", 1.0)
        .await;
    tx.commit().await.unwrap();
    env.proxy
        .wait_log("record stored after the store recovered")
        .await;
    let retry = Call::post(&url).key("k-locked").body("x").await;
    assert!(retry.is_replay(), "{}", retry.status);
    assert_eq!(env.upstream.hits(), 1, "executed once");
}

/// The statements the proxy ran on its table (pg_stat_statements), but the
/// readiness ping and the sweep.
async fn statements(pg: &PgServer) -> i64 {
    pg.query(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
         WHERE query LIKE '%idemproxy_records%' AND query NOT LIKE '%LIMIT 0%' \
         AND query NOT LIKE '%SKIP LOCKED%' AND query NOT LIKE '%pg_stat_statements%'",
    )
    .await[0]
        .get(0)
}

/// A new key is two statements (reserve, complete), a replay one: each
/// operation one statement, so one round trip once prepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_is_two_statements_and_a_replay_one() {
    let pg = PgServer::start_with(&[
        "fsync=off",
        "shared_preload_libraries=pg_stat_statements",
        "pg_stat_statements.track=all",
    ])
    .await;
    pg.client()
        .await
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    let before = statements(&pg).await;
    assert_eq!(Call::post(&url).key("k-rt").body("x").await.status, 201);
    // The completion may end just after the answer.
    let after_new = eventually("the completion's statement", DEADLINE, || async {
        let n = statements(&pg).await;
        (n >= before + 2).then_some(n)
    })
    .await;
    assert_eq!(after_new - before, 2, "a new key: reserve and complete");
    assert!(Call::post(&url).key("k-rt").body("x").await.is_replay());
    assert_eq!(
        statements(&pg).await - after_new,
        1,
        "a replay: the reserve"
    );
}

/// TLS to PostgreSQL: with `sslmode = "verify-full"` and the CA, the proxy's
/// connections are encrypted (pg_stat_ssl says so); with a CA that did not
/// sign the server's certificate, no connection is made (not ready, 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgres_is_verified_against_the_ca_file() {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    make_ca(certs.path(), "other");
    // The server reads its key as the postgres user, and wants it private.
    for (path, mode) in [("server.key", "600"), ("server.pem", "644"), (".", "755")] {
        let p = certs.path().join(path);
        let ok = Command::new("chmod")
            .arg(mode)
            .arg(&p)
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
    let _ = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(certs.path().join("server.key"))
        .status();
    let cert = format!(
        "ssl_cert_file={}",
        certs.path().join("server.pem").display()
    );
    let key = format!("ssl_key_file={}", certs.path().join("server.key").display());
    let pg = PgServer::start_with(&["fsync=off", "ssl=on", &cert, &key]).await;
    let upstream = TestUpstream::start().await;
    let store = |ca: &str| {
        format!(
            "sslmode = \"verify-full\"\ntls_ca_file = \"{}\"\nop_timeout = \"300ms\"",
            certs.path().join(ca).display()
        )
    };
    let text = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .store(&store("ca.pem"))
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-tls").body("x").await.status, 201);
    assert!(Call::post(&url).key("k-tls").body("x").await.is_replay());
    let rows = pg
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = 'idemproxy'",
        )
        .await;
    assert!(!rows.is_empty(), "the proxy's connections are listed");
    assert!(
        rows.iter().all(|r| r.get::<_, bool>(0)),
        "every connection of the proxy is TLS"
    );
    drop(proxy);

    let text = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .store(&store("other.pem"))
        .routes(ROUTES)
        .build();
    // Not waited for until ready: it never becomes ready.
    let proxy = Proxy::spawn_in_process(&text, &[]).await;
    let failed = proxy.wait_log("store ping failed").await;
    assert!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("certificate")),
        "{failed}"
    );
    let r = Call::post(&proxy.url("/v1/payments"))
        .key("k-wrong-ca")
        .body("x")
        .await;
    assert_eq!(
        r.status, 503,
        "no connection to a server the CA did not sign"
    );
    assert_eq!(upstream.hits(), 1);
}

/// Large expired rows take longer to delete than a request's statement may
/// run (`op_timeout`): each sweep batch has its own statement timeout (and
/// shrinks when even that runs out), so they are deleted all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_expired_rows_are_swept_with_a_short_op_timeout() {
    let pg = PgServer::start().await;
    let text = ConfigBuilder::new("http://127.0.0.1:1")
        .postgres(&pg)
        .store("op_timeout = \"20ms\"")
        .build();
    let cfg = idemproxy::config::Config::from_toml(&text, "t.toml", &Default::default()).unwrap();
    let metrics = std::sync::Arc::new(idemproxy::metrics::Metrics::new());
    let store = idemproxy::store::Store::new(&cfg.store, metrics, 1).unwrap();
    store.check_schema().await.unwrap();
    // 200 expired rows of 256 KiB each (stored out of line, uncompressed).
    pg.client()
        .await
        .execute(
            "INSERT INTO idemproxy_records SELECT 'idemproxy:big' || i, \
             decode(repeat(md5(i::text), 8192), 'hex'), '\\x00', true, \
             now() - interval '1 minute' FROM generate_series(1, 200) i",
            &[],
        )
        .await
        .unwrap();
    let swept = store.sweep_expired_once().await;
    assert_eq!(swept.unwrap(), 200);
    assert!(pg.keys().await.is_empty());
    let rows: i64 = pg.query("SELECT count(*) FROM idemproxy_records").await[0].get(0);
    assert_eq!(rows, 0);
}

/// The proxy's sessions do not wait for the flush (`synchronous_commit`
/// off in the URL's options, as a role or a database could set it): the
/// proxy says so when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_without_synchronous_commit_is_warned_about() {
    let pg = PgServer::start().await;
    let upstream = TestUpstream::start().await;
    let warning = "synchronous_commit is not on";
    let text = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    assert_eq!(proxy.log_count(warning), 0, "on by default: no warning");
    drop(proxy);
    let url = format!("{}?options=-c%20synchronous_commit%3Doff", pg.url());
    let text = ConfigBuilder::new(&upstream.url())
        .postgres_url(&url)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let line = proxy.wait_log(warning).await;
    assert_eq!(line["synchronous_commit"], "off", "{line}");
}

/// The first host of the URL accepts connections and never answers (a
/// frozen server); the second is the primary. Each host's attempt is
/// bounded on its own (TCP and the start-up), so the proxy gets ready and
/// serves from the second host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_host_that_hangs_is_passed_over() {
    let pg = PgServer::start().await;
    let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hang_port = hang.local_addr().unwrap().port();
    let accepted = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hang.accept().await {
            held.push(s);
        }
    });
    let upstream = TestUpstream::start().await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{hang_port},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        pg.port
    );
    let text = ConfigBuilder::new(&upstream.url())
        .postgres_url(&url)
        .store("op_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    for i in 0..5 {
        let started = std::time::Instant::now();
        let r = Call::post(&url).key(&format!("k-hang-{i}")).body("x").await;
        assert_eq!(r.status, 201, "request {i}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "request {i} took {:?}",
            started.elapsed()
        );
    }
    accepted.abort();
}

/// The server turns read-only (`default_transaction_read_only`, as a fenced
/// old primary): writes answer 503 (the connections that met it are closed,
/// and new ones refuse a read-only server under
/// `target_session_attrs=read-write`); a proxy started meanwhile pings a
/// read-only server as failed, so it is not ready (even without
/// `target_session_attrs`). Once the server is writable again, both serve
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_is_not_ready_until_writable_again() {
    let pg = PgServer::start().await;
    let upstream = TestUpstream::start().await;
    let text = ConfigBuilder::new(&upstream.url())
        .postgres_url(&format!("{}?target_session_attrs=read-write", pg.url()))
        .store("op_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    // Two proxies, each with its own logs: "store ping failed" is the late one's.
    let proxy = Proxy::in_process_apart(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    assert_eq!(
        Call::post(&url).key("k-ro-before").body("x").await.status,
        201
    );
    let admin = pg.client().await;
    admin
        .batch_execute("SET default_transaction_read_only = off")
        .await
        .unwrap();
    let read_only = |on: &'static str| {
        let admin = &admin;
        async move {
            let set = format!("ALTER SYSTEM SET default_transaction_read_only = {on}");
            admin.batch_execute(&set).await.unwrap();
            admin
                .batch_execute("SELECT pg_reload_conf()")
                .await
                .unwrap();
        }
    };
    read_only("on").await;
    eventually("writes to answer 503", DEADLINE, || {
        let url = url.clone();
        async move {
            let w = Call::post(&url).key("k-ro-during").body("x").await.status;
            (w == 503).then_some(())
        }
    })
    .await;
    let text = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .store("op_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    let late = Proxy::spawn_in_process_apart(&text, &[]).await;
    let failed = late.wait_log("store ping failed").await;
    assert!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("read-only")),
        "{failed}"
    );
    let ready = get(&late.admin_url("/readyz")).await.unwrap();
    assert_eq!(ready.status, 503, "ready on a read-only server");
    read_only("off").await;
    eventually("writes to work again", DEADLINE, || {
        let url = url.clone();
        async move { (Call::post(&url).key("k-ro-after").body("x").await.status == 201).then_some(()) }
    })
    .await;
    late.wait_ready().await;
    // Each key ran once at most: the key sent while the setting was being
    // reloaded may have run before the server turned read-only (then it was
    // answered and replayed), never twice.
    let executions = upstream.executions();
    assert_eq!(executions.get("k-ro-before"), Some(&1), "{executions:?}");
    assert_eq!(executions.get("k-ro-after"), Some(&1), "{executions:?}");
    assert!(executions.values().all(|&n| n == 1), "{executions:?}");
    assert!(executions.len() <= 3, "{executions:?}");
}

/// A row the proxy cannot read (its value NULL, the table altered under a
/// running proxy): 503, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_cannot_be_read_is_a_503_not_a_panic() {
    let env = Env::builder(Backend::Postgres).routes(ROUTES).start().await;
    let pg = env.postgres.as_ref().unwrap();
    let url = env.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-null").body("x").await.status, 201);
    eventually("the record stored", DEADLINE, || async {
        let finished: i64 = pg
            .query("SELECT count(*) FROM idemproxy_records WHERE finished")
            .await[0]
            .get(0);
        (finished == 1).then_some(())
    })
    .await;
    pg.client()
        .await
        .batch_execute(
            "ALTER TABLE idemproxy_records ALTER COLUMN value DROP NOT NULL; \
             UPDATE idemproxy_records SET value = NULL",
        )
        .await
        .unwrap();
    let r = Call::post(&url).key("k-null").body("x").await;
    assert_eq!(r.status, 503);
    assert_eq!(env.proxy.log_count("panicked"), 0, "{:?}", env.proxy.logs());
    assert_eq!(env.upstream.hits(), 1);
}

/// PostgreSQL down at start: the proxy starts, not ready, and checks the
/// table when the server first answers. A table that is not as the proxy
/// needs it (here UNLOGGED: emptied by a crash, never replicated) is then
/// never written to: protected routes answer 503 and `/readyz` stays 503,
/// with the problem logged, until the table is fixed; then they work
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_checked_after_a_late_start_is_not_written_to_until_it_is_right() {
    let mut pg = PgServer::start().await;
    pg.client()
        .await
        .batch_execute("ALTER TABLE idemproxy_records SET UNLOGGED")
        .await
        .unwrap();
    pg.kill_keeping_port();
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .store("op_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::spawn_in_process(&config, &[]).await;
    let url = proxy.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-1").body("x").await.status, 503);

    pg.restart().await;
    proxy
        .wait_log("the PostgreSQL table is not as the proxy needs it")
        .await;
    for key in ["k-1", "k-2"] {
        let r = Call::post(&url).key(key).body("x").await;
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    }
    let ready = get(&proxy.admin_url("/readyz")).await.expect("/readyz");
    assert_eq!(ready.status, 503);
    assert_eq!(upstream.hits(), 0);
    assert!(pg.keys().await.is_empty(), "{:?}", pg.keys().await);

    // Fixed while the proxy runs: checked again at its next ping, then served.
    pg.client()
        .await
        .batch_execute("ALTER TABLE idemproxy_records SET LOGGED")
        .await
        .unwrap();
    eventually("protected routes to work", DEADLINE, || {
        let url = url.clone();
        async move { (Call::post(&url).key("k-3").body("x").await.status == 201).then_some(()) }
    })
    .await;
    proxy.wait_log("the table is as the proxy needs it").await;
    assert_eq!(upstream.hits(), 1);
}

/// `RUST_LOG=debug` does not turn on tokio-postgres's statement log, which
/// would write every record (the upstream's answer, headers and body) into
/// the proxy's log, nor does naming the crate or another of its modules;
/// naming the statement log itself does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_logging_does_not_log_the_statements_parameters() {
    let pg = PgServer::start().await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .routes(ROUTES)
        .build();
    for (filter, logged) in [
        ("debug", false),
        ("debug,tokio_postgres=debug", false),
        ("debug,tokio_postgres::connection=info", false),
        ("info,tokio_postgres:=debug", false),
        ("debug,tokio_postgres::query=debug", true),
    ] {
        // The binary: RUST_LOG is the process's environment, read by its logging.
        let proxy = Proxy::spawn(&config, &[("RUST_LOG", filter)]).await;
        proxy.wait_ready().await;
        let key = format!("k-{}", filter.len());
        let r = Call::post(&proxy.url("/v1/payments"))
            .key(&key)
            .body("x")
            .await;
        assert_eq!(r.status, 201);
        // The request's access line comes after its reserve's statement,
        // whose line (when logged) is before it in the same stream.
        proxy.wait_log("idemproxy::access").await;
        assert_eq!(
            proxy.log_count("executing statement") > 0,
            logged,
            "RUST_LOG={filter}"
        );
    }
}

/// Logins slower than `op_timeout` (a relay delays every byte 150 ms each
/// way: a login takes two trips, 300 ms, and each host's attempt has 200 ms)
/// while many clients retry: the proxy's sockets to the server stay within
/// its pools' bound. Each pool holds at most its share of `pool_size` and
/// has at most as many attempts in flight; an attempt whose request gave up
/// no longer lets the next request start another one. (Without that bound
/// the attempts in flight grew with the request rate: each request that got
/// a pool slot late in its `op_timeout` started a walk and gave the slot
/// back while the walk went on.) Once logins are fast again, requests work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_logins_open_no_more_connections_than_the_pools_allow() {
    use support::relay::{Fault, Relay};
    let pg = PgServer::start().await;
    let relay = Relay::start(([127, 0, 0, 1], pg.port).into()).await;
    let upstream = TestUpstream::start().await;
    let url = pg.url().replace(
        &format!(":{}/", pg.port),
        &format!(":{}/", relay.addr.port()),
    );
    // One worker: two slots (the worker's, and slot 0 for the health ping
    // and the sweep), `pool_size = 2` shared out: one connection each.
    let (slots, per_slot) = (2, 1);
    let text = ConfigBuilder::new(&upstream.url())
        .server("workers = 1\nruntime = \"per_thread\"")
        .postgres_url(&url)
        .store("op_timeout = \"200ms\"\npool_size = 2")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    relay.set(Fault::Latency(150));
    relay.reset_peak();
    let clients = 40;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for round in 0..3 {
        let calls: Vec<_> = (0..clients)
            .map(|c| {
                let url = url.clone();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    for i in 0..5 {
                        let key = format!("k-slow-{round}-{c}-{i}");
                        seen.push(Call::post(&url).key(&key).body("x").await.status);
                    }
                    seen
                })
            })
            .collect();
        for call in calls {
            for status in call.await.unwrap() {
                *statuses.entry(status).or_default() += 1;
            }
        }
    }
    // Every attempt ends within its 200 ms once the requests are answered:
    // wait until no more than the pools' connections are open.
    eventually("the connection attempts to end", DEADLINE, || async {
        (relay.open() <= slots * per_slot).then_some(())
    })
    .await;
    let (peak, accepted) = (relay.peak(), relay.accepted());
    eprintln!("statuses {statuses:?}; relay: {accepted} accepted, at most {peak} open at once");
    assert!(
        peak <= 2 * slots * per_slot,
        "{peak} connections open at once (at most {} expected; {accepted} accepted)",
        2 * slots * per_slot
    );
    assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), [503]);
    assert!(
        proxy.log_count("already in flight") > 0,
        "{:?}",
        proxy.logs()
    );
    relay.set(Fault::Pass);
    eventually("protected routes to work again", DEADLINE, || {
        let url = url.clone();
        async move { (Call::post(&url).key("k-fast").body("x").await.status == 201).then_some(()) }
    })
    .await;
}

/// The table's check after a late start is several statements (a prepare
/// and an execute each, on a new connection). On a link slow enough that
/// together they take longer than `op_timeout`, while a request's statements
/// each fit in it, the check still passes (it has a bound of its own, not
/// the ping's `op_timeout`), and protected routes work: the proxy is not
/// held at 503 for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_late_table_check_is_not_cut_short_by_op_timeout() {
    use support::relay::{Fault, Relay};
    let mut pg = PgServer::start().await;
    let relay = Relay::start(([127, 0, 0, 1], pg.port).into()).await;
    // 80 ms a round trip: the check's 8 round trips take about 640 ms.
    relay.set(Fault::Latency(40));
    pg.kill_keeping_port();
    let upstream = TestUpstream::start().await;
    let url = pg.url().replace(
        &format!(":{}/", pg.port),
        &format!(":{}/", relay.addr.port()),
    );
    let text = ConfigBuilder::new(&upstream.url())
        .postgres_url(&url)
        .store("op_timeout = \"300ms\"")
        .routes(ROUTES)
        .build();
    let proxy = Proxy::spawn_in_process(&text, &[]).await;
    let url = proxy.url("/v1/payments");
    pg.restart().await;
    proxy.wait_log("the table is as the proxy needs it").await;
    eventually(
        "protected routes to work on the slow link",
        DEADLINE,
        || {
            let url = url.clone();
            async move {
                (Call::post(&url).key("k-slow-link").body("x").await.status == 201).then_some(())
            }
        },
    )
    .await;
    assert!(Call::post(&url)
        .key("k-slow-link")
        .body("x")
        .await
        .is_replay());
}

/// A table altered to UNLOGGED while the proxy runs (a crash would empty it,
/// and every retry would run again) is noticed within one sweep interval:
/// from then on new keys get 503 and `/readyz` is 503, nothing is written,
/// until the table is durable again; then it serves without a restart. The
/// same for a table that lost its primary key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_turns_unlogged_while_the_proxy_runs_stops_new_keys_until_it_is_logged() {
    let pg = PgServer::start().await;
    let upstream = TestUpstream::start().await;
    let config = ConfigBuilder::new(&upstream.url())
        .postgres(&pg)
        .routes(ROUTES)
        .build();
    let proxy = Proxy::spawn_in_process(&config, &[]).await;
    proxy.wait_ready().await;
    let url = proxy.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-before").body("x").await.status, 201);
    let ready = |proxy: &Proxy| {
        let url = proxy.admin_url("/readyz");
        async move { get(&url).await.expect("/readyz").status }
    };
    for (i, (broken, fixed)) in [
        (
            "ALTER TABLE idemproxy_records SET UNLOGGED",
            "ALTER TABLE idemproxy_records SET LOGGED",
        ),
        (
            "ALTER TABLE idemproxy_records DROP CONSTRAINT idemproxy_records_pkey",
            "ALTER TABLE idemproxy_records ADD PRIMARY KEY (key)",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let hits = upstream.hits();
        pg.client().await.batch_execute(broken).await.unwrap();
        // Noticed at the next sweep (every 10 s).
        eventually(
            "the proxy to turn not ready",
            Duration::from_secs(25),
            || {
                let proxy = &proxy;
                async move { (ready(proxy).await == 503).then_some(()) }
            },
        )
        .await;
        proxy
            .wait_log("the PostgreSQL table changed while the proxy runs")
            .await;
        let r = Call::post(&url)
            .key(&format!("k-broken-{i}"))
            .body("x")
            .await;
        assert_eq!(
            r.status,
            503,
            "{broken}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(upstream.hits(), hits, "{broken}: nothing forwarded");

        pg.client().await.batch_execute(fixed).await.unwrap();
        eventually("the proxy to be ready again", DEADLINE, || {
            let proxy = &proxy;
            async move { (ready(proxy).await == 200).then_some(()) }
        })
        .await;
        let r = Call::post(&url)
            .key(&format!("k-fixed-{i}"))
            .body("x")
            .await;
        assert_eq!(r.status, 201, "{fixed}");
    }
    // What was stored before still replays.
    assert!(Call::post(&url).key("k-before").body("x").await.is_replay());
}
