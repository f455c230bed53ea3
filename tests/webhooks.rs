//! Webhook receivers (§10): the key comes from another header (`key_from =
//! "header:X-GitHub-Delivery"`) or from the JSON body (`key_from = "json:/id"`).
//! Real redis-server (or the memory store), a real upstream, the proxy served in-process.

mod support;

use support::*;

const ROUTES: &str = r#"
[defaults]
lease = "10s"

[[routes]]
name = "github"
path = "/hooks/github"
key_from = "header:X-GitHub-Delivery"

[[routes]]
name = "stripe"
path = "/hooks/stripe"
key_from = "json:/id"

[[routes]]
name = "small"
path = "/hooks/small"
key_from = "json:/id"
max_request_body = "1KiB"
max_key_length = 16

[[routes]]
name = "optional"
path = "/hooks/optional"
key_from = "json:/id"
key = "optional"
max_key_length = 16

[[routes]]
name = "nested"
path = "/hooks/nested"
key_from = "json:/data/object/id"

[[routes]]
name = "escaped"
path = "/hooks/escaped"
key_from = "json:/a~1b/m~0n"

[[routes]]
name = "header-small"
path = "/hooks/header-small"
max_request_body = "1KiB"

[[routes]]
name = "shadow"
path = "/hooks/shadow"
key_from = "json:/id"
mode = "shadow"
max_request_body = "1KiB"
"#;

on_every_backend!(
    a_github_delivery_sent_twice_runs_once,
    a_stripe_event_sent_twice_runs_once,
    the_same_event_id_with_another_body_is_422_and_in_flight_is_409,
    nested_pointers_and_escaped_names,
    integer_ids_keep_their_exact_text,
    no_string_or_integer_at_the_pointer_is_a_missing_key,
    empty_and_over_long_json_keys_are_400_even_on_optional_routes,
    an_optional_route_forwards_a_body_without_a_key_unprotected,
    json_keys_check_the_size_first_header_keys_the_key_first,
    scope_keeps_senders_apart,
    shadow_mode_counts_json_keys_and_forwards_everything,
    a_forged_delivery_refused_401_or_403_does_not_take_the_genuine_ones_id,
);

async fn env(backend: Backend) -> Env {
    Env::with_routes(backend, ROUTES).await
}

/// A webhook delivery as senders post them.
fn hook(env: &Env, path: &str) -> Call {
    Call::post(&env.url(path)).header("content-type", "application/json")
}

async fn nothing_stored(env: &Env) {
    if let Some(keys) = env.store_keys().await {
        assert!(keys.is_empty(), "nothing reserved: {keys:?}");
    }
}

const DELIVERY: &str = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
const PUSH: &str =
    r#"{"ref":"refs/heads/main","after":"0d1a26e67d8f5eaf1f6ba5c57fc3c7d91ac0fd1c"}"#;

async fn a_github_delivery_sent_twice_runs_once(backend: Backend) {
    let env = env(backend).await;
    let deliver = |id: &str| {
        hook(&env, "/hooks/github")
            .header("x-github-event", "push")
            .header("x-github-delivery", id)
            .body(PUSH)
    };
    let first = deliver(DELIVERY).await;
    assert_eq!(first.status, 201);
    assert!(!first.is_replay());
    let retry = deliver(DELIVERY).await;
    assert_eq!(env.upstream.hits(), 1, "a redelivery must not run again");
    assert!(retry.is_replay());
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    // The header reaches the upstream as it came.
    let seen = env.upstream.seen();
    assert_eq!(seen[0].headers["x-github-delivery"], DELIVERY);
    // Another delivery runs; Idempotency-Key is not where this route looks.
    let other = deliver("8e03978e-40d5-43e8-bc93-6894a57f9324").await;
    assert!(!other.is_replay());
    assert_eq!(env.upstream.hits(), 2);
    let r = hook(&env, "/hooks/github").key("k-1").body(PUSH).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "idempotency-key-missing");
    assert_eq!(r.json()["idempotency_key"]["header"], "x-github-delivery");
    let detail = r.json()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("x-github-delivery"), "{detail}");
    // The header follows the key syntax of §7.
    for bad in ["a,b", "a b", "\"open"] {
        let r = deliver(bad).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["type"], "idempotency-key-invalid", "{bad}");
    }
    assert_eq!(env.upstream.hits(), 2);
}

const EVENT: &str = r#"{"id":"evt_1","object":"event","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#;

async fn a_stripe_event_sent_twice_runs_once(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/stripe";
    let first = hook(&env, url)
        .header("stripe-signature", "t=1,v1=aaa")
        .body(EVENT)
        .await;
    assert_eq!(first.status, 201);
    assert!(!first.is_replay());
    // A retry is signed anew; only the body (and its id) is the same.
    let retry = hook(&env, url)
        .header("stripe-signature", "t=2,v1=bbb")
        .body(EVENT)
        .await;
    assert_eq!(env.upstream.hits(), 1, "a retried event must not run again");
    assert!(retry.is_replay());
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    // The key is the id: an Idempotency-Key header changes nothing.
    let with_header = hook(&env, url).key("something-else").body(EVENT).await;
    assert!(with_header.is_replay());
    // Another event runs.
    let other = hook(&env, url).body(EVENT.replace("evt_1", "evt_2")).await;
    assert!(!other.is_replay());
    assert_eq!(env.upstream.hits(), 2);
}

async fn the_same_event_id_with_another_body_is_422_and_in_flight_is_409(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/stripe";
    hook(&env, url).body(EVENT).await;
    let changed = EVENT.replace("succeeded", "failed");
    let r = hook(&env, url).body(changed).await;
    assert_eq!(r.status, 422);
    assert_eq!(r.json()["type"], "idempotency-key-reused");
    // A retry while the first is still running: 409 with Retry-After.
    let held = hook(&env, url)
        .header("x-test-hold", "1")
        .spawn(EVENT.replace("evt_1", "evt_held"));
    env.upstream.wait_hits(2).await;
    let r = hook(&env, url)
        .body(EVENT.replace("evt_1", "evt_held"))
        .await;
    assert_eq!(r.status, 409);
    assert!(r.header("retry-after").is_some());
    env.upstream.release(1);
    assert_eq!(held.await.unwrap().status, 201);
    assert_eq!(env.upstream.hits(), 2);
}

async fn nested_pointers_and_escaped_names(backend: Backend) {
    let env = env(backend).await;
    // json:/data/object/id
    let nested = r#"{"id":"evt_9","data":{"object":{"id":"pi_9","amount":100}}}"#;
    hook(&env, "/hooks/nested").body(nested).await;
    assert!(hook(&env, "/hooks/nested").body(nested).await.is_replay());
    // Another event about the same object: the key is the object's id.
    let same_object = nested.replace("evt_9", "evt_10");
    assert_eq!(
        hook(&env, "/hooks/nested").body(same_object).await.status,
        422
    );
    assert_eq!(env.upstream.hits(), 1);
    let r = hook(&env, "/hooks/nested")
        .body(r#"{"data":{"id":"pi_9"}}"#)
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["idempotency_key"]["json_pointer"],
        "/data/object/id"
    );

    // json:/a~1b/m~0n is the member "m~n" of the member "a/b".
    let escaped = r#"{"a/b":{"m~n":"x-1"}}"#;
    let first = hook(&env, "/hooks/escaped").body(escaped).await;
    assert_eq!(first.status, 201);
    assert!(hook(&env, "/hooks/escaped").body(escaped).await.is_replay());
    assert_eq!(env.upstream.hits(), 2);
    for not_there in [
        r#"{"a":{"b":{"m~n":"x-1"}}}"#,
        r#"{"a~1b":{"m~0n":"x-1"}}"#,
        r#"{"a/b":{"m":{"n":"x-1"}}}"#,
    ] {
        let r = hook(&env, "/hooks/escaped").body(not_there).await;
        assert_eq!(r.status, 400, "{not_there}");
        assert_eq!(r.json()["type"], "idempotency-key-missing");
        assert_eq!(r.json()["idempotency_key"]["json_pointer"], "/a~1b/m~0n");
    }
    assert_eq!(env.upstream.hits(), 2);
}

async fn integer_ids_keep_their_exact_text(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/stripe";
    let event = |id: &str| format!(r#"{{"id":{id},"type":"t"}}"#);
    hook(&env, url).body(event("12345")).await;
    assert!(hook(&env, url).body(event("12345")).await.is_replay());
    // Its decimal text is the key: the string "12345" is the same key, with another body.
    assert_eq!(hook(&env, url).body(event("\"12345\"")).await.status, 422);
    assert_eq!(env.upstream.hits(), 1);
    // Beyond 64 bits, and beyond what a double tells apart (both are 1e20 as f64):
    // two different keys.
    let big = hook(&env, url).body(event("100000000000000000001")).await;
    let next = hook(&env, url).body(event("100000000000000000000")).await;
    assert!(!big.is_replay() && !next.is_replay());
    assert_eq!(env.upstream.hits(), 3);
    assert!(hook(&env, url)
        .body(event("100000000000000000001"))
        .await
        .is_replay());
    // A number with a fraction or an exponent is not an integer: a missing key.
    for not_integer in ["12345.0", "1.2345e4", "1E5"] {
        let r = hook(&env, url).body(event(not_integer)).await;
        assert_eq!(r.status, 400, "{not_integer}");
        assert_eq!(r.json()["type"], "idempotency-key-missing");
    }
    assert_eq!(env.upstream.hits(), 3);
}

async fn no_string_or_integer_at_the_pointer_is_a_missing_key(backend: Backend) {
    let env = env(backend).await;
    for body in [
        "id=evt_1",
        "",
        r#"{"id":"evt_1""#,
        r#"{"type":"no id"}"#,
        r#"{"id":["evt_1"]}"#,
        r#"{"id":{"id":"evt_1"}}"#,
        r#"{"id":true}"#,
        r#"{"id":null}"#,
        r#"["evt_1"]"#,
        r#""evt_1""#,
        // Parsers disagree on which of two members counts: no key is taken from it.
        r#"{"id":"evt_1","id":"evt_2"}"#,
    ] {
        let r = hook(&env, "/hooks/stripe").body(body).await;
        assert_eq!(r.status, 400, "{body}");
        let v = r.json();
        assert_eq!(v["type"], "idempotency-key-missing", "{body}");
        assert_eq!(v["idempotency_key"]["json_pointer"], "/id");
        assert!(v["detail"].as_str().unwrap().contains("/id"));
    }
    assert_eq!(env.upstream.hits(), 0);
    nothing_stored(&env).await;
    let series = "idemproxy_requests_total{route=\"stripe\",outcome=\"missing_key\"}";
    assert_eq!(env.metric(series).await, 11.0);
}

async fn empty_and_over_long_json_keys_are_400_even_on_optional_routes(backend: Backend) {
    let env = env(backend).await;
    for path in ["/hooks/small", "/hooks/optional"] {
        for (id, why) in [
            ("\"\"", "empty"),
            ("\"abcdefghijklmnopq\"", "17 characters"),
            ("12345678901234567", "17 characters"),
        ] {
            let r = hook(&env, path).body(format!(r#"{{"id":{id}}}"#)).await;
            assert_eq!(r.status, 400, "{path} {id}");
            let v = r.json();
            assert_eq!(v["type"], "idempotency-key-invalid", "{path} {id}");
            assert!(v["detail"].as_str().unwrap().contains(why), "{v}");
        }
        // 16 characters (32 bytes) are within max_key_length: it counts characters.
        // (One id per route: the record id does not depend on the route.)
        let id = format!("{}{}", "é".repeat(14), path.len());
        let r = hook(&env, path).body(format!(r#"{{"id":"{id}"}}"#)).await;
        assert_eq!(r.status, 201, "{path}");
    }
    assert_eq!(env.upstream.hits(), 2);
}

async fn an_optional_route_forwards_a_body_without_a_key_unprotected(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/optional";
    for body in ["not json", r#"{"type":"no id"}"#, r#"{"id":null}"#] {
        for _ in 0..2 {
            let r = hook(&env, url).body(body).await;
            assert_eq!(r.status, 201, "{body}");
            assert!(!r.is_replay());
            assert_eq!(
                r.json()["body_len"],
                body.len(),
                "the body is forwarded whole"
            );
        }
    }
    assert_eq!(
        env.upstream.hits(),
        6,
        "without a key every request executes"
    );
    nothing_stored(&env).await;
    // With one it is protected.
    hook(&env, url).body(r#"{"id":"evt_o"}"#).await;
    assert!(hook(&env, url).body(r#"{"id":"evt_o"}"#).await.is_replay());
    assert_eq!(env.upstream.hits(), 7);
}

async fn json_keys_check_the_size_first_header_keys_the_key_first(backend: Backend) {
    let env = env(backend).await;
    let padding = "x".repeat(1100);
    // json: the body is read first, so a body over the limit is a 413 whatever its key.
    for body in [
        format!(r#"{{"id":"evt_big","pad":"{padding}"}}"#),
        format!(r#"{{"pad":"{padding}"}}"#),
        format!(r#"{{"id":"","pad":"{padding}"}}"#),
        padding.clone(),
    ] {
        let r = hook(&env, "/hooks/small").body(body).await;
        assert_eq!(r.status, 413);
        assert_eq!(r.json()["type"], "request-too-large");
    }
    // Without Content-Length (chunked) too.
    let chunked = raw(
        env.proxy.addr,
        format!(
            "POST /hooks/small HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n400\r\n{}\r\n400\r\n{}\r\n0\r\n\r\n",
            "y".repeat(1024),
            "y".repeat(1024)
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(raw_status(&chunked), 413, "{chunked}");
    // A header key is still checked before the body: 400 first.
    let url = "/hooks/header-small";
    let r = hook(&env, url).body(padding.clone()).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "idempotency-key-missing");
    let r = hook(&env, url).key("a,b").body(padding.clone()).await;
    assert_eq!(r.status, 400);
    let r = hook(&env, url).key("k-big").body(padding).await;
    assert_eq!(r.status, 413);
    assert_eq!(env.upstream.hits(), 0);
    nothing_stored(&env).await;
    // The id is still free.
    let ok = hook(&env, "/hooks/small").body(r#"{"id":"evt_big"}"#).await;
    assert_eq!(ok.status, 201);
    assert!(!ok.is_replay());
}

async fn scope_keeps_senders_apart(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/stripe";
    let send = |auth: &'static str| hook(&env, url).header("authorization", auth).body(EVENT);
    let alice = send("Bearer alice").await;
    let bob = send("Bearer bob").await;
    assert!(!bob.is_replay(), "bob must not get alice's answer");
    assert_ne!(alice.body, bob.body);
    assert_eq!(env.upstream.hits(), 2);
    assert!(send("Bearer alice").await.is_replay());
    assert!(send("Bearer bob").await.is_replay());
    // The store key is the id's hash with the scope: neither appears in it.
    if let Some(keys) = env.store_keys().await {
        assert_eq!(keys.len(), 2);
        assert!(keys.iter().all(|k| !k.contains("evt_1")), "{keys:?}");
    }
    assert_eq!(env.upstream.hits(), 2);
}

async fn shadow_mode_counts_json_keys_and_forwards_everything(backend: Backend) {
    let env = env(backend).await;
    let url = "/hooks/shadow";
    for body in [
        EVENT.to_string(),
        EVENT.to_string(),
        "not json".to_string(),
        r#"{"id":""}"#.to_string(),
        format!(r#"{{"id":"evt_big","pad":"{}"}}"#, "x".repeat(1100)),
    ] {
        let r = hook(&env, url).body(body.clone()).await;
        assert_eq!(r.status, 201, "shadow mode forwards {body:.40}");
        assert!(!r.is_replay());
        assert_eq!(r.json()["body_len"], body.len());
    }
    assert_eq!(env.upstream.hits(), 5, "every request reached the upstream");
    for (outcome, n) in [
        ("replayed", 1.0),
        ("missing_key", 1.0),
        ("invalid_key", 1.0),
    ] {
        let series =
            format!("idemproxy_shadow_outcomes_total{{route=\"shadow\",outcome=\"{outcome}\"}}");
        assert_eq!(env.metric(&series).await, n, "{series}");
    }
}

/// A forger who guesses a delivery id sends it first with a body of its own;
/// the app refuses it (bad signature: 401, or 403). By default neither is
/// stored (§4 `release_statuses`), so the genuine delivery with that id runs
/// and is answered, instead of a 422 for the whole TTL.
async fn a_forged_delivery_refused_401_or_403_does_not_take_the_genuine_ones_id(backend: Backend) {
    let env = env(backend).await;
    for (status, id) in [(401, "evt_forged_401"), (403, "evt_forged_403")] {
        let genuine = EVENT.replace("evt_1", id);
        let forged = genuine.replace("succeeded", "refunded");
        let refused = hook(&env, "/hooks/stripe")
            .header("x-test-status", &status.to_string())
            .body(forged)
            .await;
        assert_eq!(refused.status, status);
        let r = hook(&env, "/hooks/stripe").body(genuine.clone()).await;
        assert_eq!(
            r.status, 201,
            "the genuine delivery after a forged {status}"
        );
        assert!(!r.is_replay());
        let again = hook(&env, "/hooks/stripe").body(genuine).await;
        assert!(again.is_replay(), "the genuine one is the one kept");
    }
    assert_eq!(env.upstream.hits(), 4);
    let released = r#"idemproxy_requests_total{route="stripe",outcome="released"}"#;
    assert_eq!(env.metric(released).await, 2.0);
}
