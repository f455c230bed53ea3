//! Records sealed at rest (§10): `[store] encryption_key_file`, through the
//! proxy (in-process, or the binary for SIGHUP reloads and restarts), a real
//! redis-server and the test upstream.

mod support;

use support::*;

/// Three keys, as `head -c 32 /dev/urandom | base64` makes them.
const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const K2: &str = "k2:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
const K3: &str = "k3:wlJ+0nJdEd3xLpY0Hn6tMbq7nW1cQ4fZ8eV2rS9uTgA=";
const TOKEN: &str = "sealed-admin-token";

/// The base64 text of a key line: what must never be shown.
fn secret(line: &str) -> &str {
    line.split_once(':').unwrap().1
}

/// A key file in a directory of its own, rewritten as the test goes on.
struct KeyFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

impl KeyFile {
    fn new(lines: &[&str]) -> KeyFile {
        let dir = tempfile::tempdir().unwrap();
        let keys = KeyFile {
            path: dir.path().join("record-keys"),
            _dir: dir,
        };
        keys.write(lines);
        keys
    }

    fn write(&self, lines: &[&str]) {
        std::fs::write(&self.path, lines.join("\n") + "\n").unwrap();
    }

    /// The `[store]` line that names it.
    fn store_line(&self) -> String {
        format!("encryption_key_file = \"{}\"", self.path.display())
    }
}

fn sealed_env(backend: Backend, keys: &KeyFile) -> EnvBuilder {
    Env::builder(backend)
        .store(&keys.store_line())
        .proxy_env("IDEMPROXY_ADMIN_TOKEN", TOKEN)
}

fn record_id(key: &str) -> String {
    idemproxy::key::record_id([], key)
}

fn store_key(key: &str) -> String {
    format!("idemproxy:{}", record_id(key))
}

/// The admin API's view of the record for `key`.
async fn admin_view(proxy: &Proxy, key: &str) -> serde_json::Value {
    let req = http::Request::get(proxy.admin_url(&format!("/keys/{}", record_id(key))))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let r = send(req).await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The value Redis holds under `key`, byte for byte.
async fn raw(redis: &RedisServer, key: &str) -> Vec<u8> {
    let mut c = redis.conn().await.unwrap();
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut c)
        .await
        .unwrap()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn assert_no_key_in(proxy: &Proxy) {
    for line in proxy.logs() {
        for key in [K1, K2, K3] {
            assert!(!line.contains(secret(key)), "a key in the logs: {line}");
        }
    }
}

on_every_backend!(
    a_sealed_record_replays_and_is_stored_sealed,
    rotation_keeps_old_records_until_their_key_is_removed,
    large_records_are_sealed_and_replayed,
    a_failed_key_reload_keeps_the_keys_in_use,
);

async fn a_sealed_record_replays_and_is_stored_sealed(backend: Backend) {
    let keys = KeyFile::new(&[K1]);
    let env = sealed_env(backend, &keys).start().await;
    let url = env.url("/v1/payments");
    let held = Call::post(&url)
        .key("k-sealed")
        .header("x-test-hold", "1")
        .spawn("{\"amount\":1}");
    env.upstream.wait_hits(1).await;
    // The reservation is clear, as the store's scripts need it.
    let reservation = match &env.redis {
        Some(redis) => raw(redis, &store_key("k-sealed")).await,
        None => Vec::new(),
    };
    env.upstream.release(1);
    let first = held.await.unwrap();
    assert_eq!(first.status, 201);
    let again = Call::post(&url)
        .key("k-sealed")
        .body("{\"amount\":1}")
        .await;
    assert!(again.is_replay());
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    for name in ["location", "x-custom", "content-type", "server"] {
        assert_eq!(again.header(name), first.header(name), "{name}");
    }
    assert_eq!(env.upstream.hits(), 1);

    // The admin API shows the clear head: state, status, times; never the answer.
    let view = admin_view(&env.proxy, "k-sealed").await;
    assert_eq!(view["state"], "finished");
    assert_eq!(view["status"], 201);
    assert_eq!(view["sealed"], true);
    assert_eq!(view["key_id"], "k1");
    assert!(view["expires_in_seconds"].as_u64().unwrap() > 86_000);
    let shown = view.to_string();
    assert!(!shown.contains("custom-value") && !shown.contains("/things/1"));

    if let Some(redis) = &env.redis {
        let stored = raw(redis, &store_key("k-sealed")).await;
        assert_eq!((stored[0], stored[1]), (3, b'F'), "format 3, finished");
        assert_eq!((reservation[0], reservation[1]), (1, b'P'));
        assert_eq!(
            stored[2..18],
            reservation[2..18],
            "the owner token stays where the scripts read it"
        );
        assert!(contains(&stored, b"payments"), "the route stays clear");
        for answer in [
            &first.body[..],
            b"\"method\":\"POST\"",
            b"/things/1",
            b"custom-value",
            b"test-upstream/1",
            b"application/json",
        ] {
            let text = String::from_utf8_lossy(answer);
            assert!(!contains(&stored, answer), "{text} stored in the clear");
        }
    }
    assert_no_key_in(&env.proxy);
}

/// Keys are reloaded on SIGHUP, by the binary: this scenario starts it.
async fn rotation_keeps_old_records_until_their_key_is_removed(backend: Backend) {
    let keys = KeyFile::new(&[K1]);
    // The binary: the keys are reloaded on SIGHUP sent to it.
    let env = sealed_env(backend, &keys).binary().start().await;
    let url = env.url("/v1/payments");
    let old = Call::post(&url).key("k-old").body("x").await;
    assert_eq!(old.status, 201);
    assert_eq!(admin_view(&env.proxy, "k-old").await["key_id"], "k1");

    // A new first key: it seals new records; the old one still opens its own.
    keys.write(&["# new first", K2, K1]);
    env.proxy.signal("HUP");
    let line = env.proxy.wait_nth_log("encryption keys reloaded", 1).await;
    assert_eq!(line["sealing_key_id"], "k2");
    let replay = Call::post(&url).key("k-old").body("x").await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, old.body);
    let new = Call::post(&url).key("k-new").body("x").await;
    assert_eq!(new.status, 201);
    assert_eq!(admin_view(&env.proxy, "k-new").await["key_id"], "k2");
    assert_eq!(env.upstream.hits(), 2);

    // The old key removed: its records cannot be read (500), never re-executed.
    keys.write(&[K2]);
    env.proxy.signal("HUP");
    env.proxy.wait_nth_log("encryption keys reloaded", 2).await;
    let r = Call::post(&url).key("k-old").body("x").await;
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["type"], "record-unreadable");
    assert_eq!(r.json()["retryable"], false);
    assert_eq!(env.upstream.hits(), 2, "never forwarded");
    let error = env.proxy.wait_log("cannot be read; not forwarding").await;
    assert_eq!(error["record_id"], record_id("k-old").as_str());
    assert_eq!(error["level"], "ERROR");
    let why = error["error"].as_str().unwrap();
    assert!(
        why.contains("\"k1\", which the key file does not hold"),
        "{why}"
    );
    let unreadable = "idemproxy_requests_total{route=\"payments\",outcome=\"unreadable\"}";
    assert_eq!(env.metric(unreadable).await, 1.0);
    // Its head still shows, and the records of the kept key still replay.
    assert_eq!(admin_view(&env.proxy, "k-old").await["status"], 201);
    assert!(Call::post(&url).key("k-new").body("x").await.is_replay());
    assert_no_key_in(&env.proxy);
}

async fn large_records_are_sealed_and_replayed(backend: Backend) {
    let keys = KeyFile::new(&[K1]);
    let env = sealed_env(backend, &keys).start().await;
    let url = env.url("/v1/payments");
    // Over 256 KiB: Redis takes it in pieces, and a reserve does not bring it back inline.
    let size = 600_000;
    let first = Call::post(&url)
        .key("k-large")
        .header("x-test-body-bytes", &size.to_string())
        .body("x")
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, binary(size));
    let again = Call::post(&url)
        .key("k-large")
        .header("x-test-body-bytes", &size.to_string())
        .body("x")
        .await;
    assert!(again.is_replay());
    assert_eq!(again.body, binary(size));
    assert_eq!(env.upstream.hits(), 1);
    if let Some(redis) = &env.redis {
        let stored = raw(redis, &store_key("k-large")).await;
        assert_eq!((stored[0], stored[1]), (3, b'F'));
        assert!(stored.len() > size && stored.len() < size + 1024);
        let body = binary(size);
        for at in [0, 300_000, size - 64] {
            assert!(!contains(&stored, &body[at..at + 64]), "body at {at}");
        }
    }
}

/// Keys are reloaded on SIGHUP, by the binary: this scenario starts it.
async fn a_failed_key_reload_keeps_the_keys_in_use(backend: Backend) {
    let keys = KeyFile::new(&[K1]);
    // The binary: the keys are reloaded on SIGHUP sent to it.
    let env = sealed_env(backend, &keys).binary().start().await;
    let url = env.url("/v1/payments");
    assert_eq!(Call::post(&url).key("k-a").body("x").await.status, 201);

    // A short key on line 2: the reload fails, naming the line, not the key.
    let short = format!("k2:{}", &secret(K2)[..20]);
    keys.write(&[K1, &short]);
    env.proxy.signal("HUP");
    let failed = env
        .proxy
        .wait_nth_log("encryption key reload failed", 1)
        .await;
    let error = failed["error"].as_str().unwrap();
    let at = format!("{}:2: store.encryption_key_file", keys.path.display());
    assert!(error.contains(&at), "{error}");
    assert!(!error.contains(&secret(K2)[..20]), "{error}");
    assert!(Call::post(&url).key("k-a").body("x").await.is_replay());
    assert_eq!(Call::post(&url).key("k-b").body("x").await.status, 201);
    assert_eq!(admin_view(&env.proxy, "k-b").await["key_id"], "k1");

    // A file that is gone: the same.
    std::fs::remove_file(&keys.path).unwrap();
    env.proxy.signal("HUP");
    let failed = env
        .proxy
        .wait_nth_log("encryption key reload failed", 2)
        .await;
    assert!(failed["error"].as_str().unwrap().contains("cannot read"));
    assert!(Call::post(&url).key("k-b").body("x").await.is_replay());

    // A later reload still applies.
    keys.write(&[K3, K1]);
    env.proxy.signal("HUP");
    env.proxy.wait_nth_log("encryption keys reloaded", 1).await;
    assert_eq!(Call::post(&url).key("k-c").body("x").await.status, 201);
    assert_eq!(admin_view(&env.proxy, "k-c").await["key_id"], "k3");
    assert!(Call::post(&url).key("k-a").body("x").await.is_replay());
    assert_eq!(env.upstream.hits(), 3);
    assert_no_key_in(&env.proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_records_written_before_sealing_was_switched_on_still_replay() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let plain = ConfigBuilder::new(&upstream.url()).redis(&redis);
    // The binary: SIGTERM is sent to it, and its exit code read.
    let mut proxy = Proxy::start(&plain.build()).await;
    let first = Call::post(&proxy.url("/v1/payments"))
        .key("k-clear")
        .body("x")
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(raw(&redis, &store_key("k-clear")).await[0], 1);
    proxy.signal("TERM");
    assert_eq!(proxy.wait_exit().await, Some(0));

    let keys = KeyFile::new(&[K1]);
    let proxy = Proxy::in_process(&plain.store(&keys.store_line()).build(), &[]).await;
    let again = Call::post(&proxy.url("/v1/payments"))
        .key("k-clear")
        .body("x")
        .await;
    assert!(again.is_replay());
    assert_eq!(again.body, first.body);
    assert_eq!(upstream.hits(), 1);
    let new = Call::post(&proxy.url("/v1/payments"))
        .key("k-sealed")
        .body("x")
        .await;
    assert_eq!(new.status, 201);
    assert_eq!(raw(&redis, &store_key("k-sealed")).await[0], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_value_copied_under_another_record_id_does_not_open() {
    let keys = KeyFile::new(&[K1]);
    let env = sealed_env(Backend::Redis, &keys).start().await;
    let redis = env.redis.as_ref().unwrap();
    let url = env.url("/v1/payments");
    // The same request under two keys: the same fingerprint, so only the
    // record id tells the two records apart.
    for key in ["k-a", "k-b"] {
        assert_eq!(Call::post(&url).key(key).body("same").await.status, 201);
    }
    let a = raw(redis, &store_key("k-a")).await;
    let mut c = redis.conn().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(store_key("k-b"))
        .arg(&a)
        .arg("KEEPTTL")
        .query_async(&mut c)
        .await
        .unwrap();
    let r = Call::post(&url).key("k-b").body("same").await;
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["type"], "record-unreadable");
    assert_eq!(env.upstream.hits(), 2, "never forwarded");
    let error = env.proxy.wait_log("cannot be read; not forwarding").await;
    assert_eq!(error["record_id"], record_id("k-b").as_str());
    assert!(error["error"].as_str().unwrap().contains("does not open"));
    // Under its own id the same bytes still replay.
    assert!(Call::post(&url).key("k-a").body("same").await.is_replay());
}

fn config_with(keys: &KeyFile) -> String {
    ConfigBuilder::new("http://127.0.0.1:1")
        .store(&keys.store_line())
        .build()
}

#[test]
fn a_malformed_key_file_exits_2_naming_the_line_and_never_the_key() {
    let short = format!("k2:{}", &secret(K2)[..20]);
    let no_colon = format!("k2{}", secret(K2));
    let bad_id = format!("k 2!:{}", secret(K2));
    let cases: [(Vec<&str>, &str, &str); 5] = [
        (vec![K1, &short], ":2: ", "is 15 bytes; AES-256 needs 32"),
        (
            vec!["# keys", "", K1, &no_colon],
            ":4: ",
            "expected <key id>:",
        ),
        (vec![&bad_id, K1], ":1: ", "key id must be"),
        (vec![K1, K3, K1], ":3: ", "already used on line 1"),
        (vec!["# nothing yet"], ": ", "holds no key"),
    ];
    for (lines, at, says) in cases {
        let keys = KeyFile::new(&lines);
        for check in [true, false] {
            let out = run_to_exit(&config_with(&keys), check);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{lines:?} check={check}: {err}");
            let named = format!("{}{at}store.encryption_key_file: ", keys.path.display());
            assert!(err.contains(&named) && err.contains(says), "{err}");
            for key in [K1, K2, K3] {
                assert!(!err.contains(&secret(key)[..16]), "{err}");
            }
        }
    }
}

#[test]
fn a_missing_key_file_stops_the_start_but_check_only_warns() {
    let keys = KeyFile::new(&[K2, K1]);
    let out = run_to_exit(&config_with(&keys), true);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("records sealed at rest: sealing key id k2, opening key ids k2,k1"),
        "{stdout}"
    );
    assert!(!stdout.contains(secret(K1)) && !stdout.contains(secret(K2)));

    std::fs::remove_file(&keys.path).unwrap();
    let path = keys.path.display().to_string();
    let out = run_to_exit(&config_with(&keys), true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("is valid"));
    assert!(
        err.contains("warning: cannot read store.encryption_key_file") && err.contains(&path),
        "{err}"
    );
    let out = run_to_exit(&config_with(&keys), false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot read store.encryption_key_file") && err.contains(&path),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_require_sealed_a_clear_record_is_never_replayed() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    // A clear record, as anyone who can write to the store could plant one.
    let plain = ConfigBuilder::new(&upstream.url()).redis(&redis);
    // The binary: SIGTERM is sent to it, and its exit code read.
    let mut proxy = Proxy::start(&plain.build()).await;
    let url = proxy.url("/v1/payments");
    assert_eq!(
        Call::post(&url).key("k-planted").body("x").await.status,
        201
    );
    assert_eq!(raw(&redis, &store_key("k-planted")).await[0], 1);
    proxy.signal("TERM");
    assert_eq!(proxy.wait_exit().await, Some(0));

    let keys = KeyFile::new(&[K1]);
    let strict = plain
        .store(&keys.store_line())
        .store("require_sealed = true");
    let proxy = Proxy::in_process(&strict.build(), &[]).await;
    let url = proxy.url("/v1/payments");
    let r = Call::post(&url).key("k-planted").body("x").await;
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["type"], "record-unreadable");
    assert!(!r.is_replay());
    assert_eq!(upstream.hits(), 1, "never forwarded");
    let error = proxy.wait_log("cannot be read; not forwarding").await;
    assert!(
        error["error"].as_str().unwrap().contains("not sealed"),
        "{error}"
    );
    // Sealed records are written and replayed as usual.
    assert_eq!(Call::post(&url).key("k-new").body("x").await.status, 201);
    assert!(Call::post(&url).key("k-new").body("x").await.is_replay());
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn require_sealed_needs_a_key_file_and_check_says_how_to_switch_it_on() {
    let without = ConfigBuilder::new("http://127.0.0.1:1")
        .store("require_sealed = true")
        .build();
    for check in [true, false] {
        let out = run_to_exit(&without, check);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "check={check}: {err}");
        assert!(
            err.contains("store.require_sealed") && err.contains("encryption_key_file"),
            "{err}"
        );
    }
    let keys = KeyFile::new(&[K1]);
    let out = run_to_exit(&config_with(&keys), true);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("set [store] require_sealed = true"),
        "{stdout}"
    );
    let strict = ConfigBuilder::new("http://127.0.0.1:1")
        .store(&keys.store_line())
        .store("require_sealed = true")
        .build();
    let out = run_to_exit(&strict, true);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("require_sealed: a finished record in the clear is unreadable"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_sealed_under_a_key_no_longer_held_is_unreadable_from_its_head() {
    let redis = RedisServer::start().await;
    let upstream = TestUpstream::start().await;
    let old = KeyFile::new(&[K1]);
    let base = ConfigBuilder::new(&upstream.url()).redis(&redis);
    // The binary: SIGTERM is sent to it, and its exit code read.
    let mut proxy = Proxy::start(&base.clone().store(&old.store_line()).build()).await;
    let large = Call::post(&proxy.url("/v1/payments"))
        .key("k-large-sealed")
        .header("x-test-body-bytes", "200000")
        .body("x")
        .await;
    assert_eq!(large.status, 201);
    proxy.signal("TERM");
    assert_eq!(proxy.wait_exit().await, Some(0));
    // K1 removed: its records do not open; a large one is judged from its
    // head, and that head names a key this proxy does not hold.
    let new = KeyFile::new(&[K2]);
    let proxy = Proxy::in_process(&base.store(&new.store_line()).build(), &[]).await;
    for body in ["x", "another body"] {
        let r = Call::post(&proxy.url("/v1/payments"))
            .key("k-large-sealed")
            .body(body)
            .await;
        assert_eq!(
            r.status,
            500,
            "{body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["type"], "record-unreadable");
    }
    assert_eq!(upstream.hits(), 1);
}
