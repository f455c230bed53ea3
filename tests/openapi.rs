//! `idemproxy openapi routes` and `annotate` on real OpenAPI documents
//! (tests/fixtures/openapi: Stripe's, GitHub's, the OpenAPI Initiative's
//! petstore) and on documents written here: the routes pass `--check`, the
//! annotated documents pass openapi-spec-validator 0.9
//! (tests/peers/openapi_validate.py), the protected operations get what
//! the proxy adds and every other one is left as it was.

#[path = "openapi/helpers.rs"]
mod helpers;
#[path = "openapi/hostile.rs"]
mod hostile;
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use helpers::*;

/// The whole round on a real document: routes (none without
/// `--unsafe-methods`, as no real document marks `x-idempotency-key`),
/// `--check`, annotate, and what changed. Returns the annotated file.
fn round(dir: &Path, doc: &Path, expect: [usize; 3]) -> PathBuf {
    let file = doc.to_str().unwrap();
    let none = refused(&["openapi", "routes", file]);
    assert!(none.contains("no operation selected"), "{none}");
    let (toml_text, notes) = ok(&["openapi", "routes", "--unsafe-methods", file]);
    let routes = routes_of(&toml_text);
    let [operations_found, selected, written] = expect;
    assert_eq!(
        summary(&notes),
        vec![operations_found, selected, written],
        "{notes}"
    );
    assert_eq!(routes.len(), written);
    let names: BTreeSet<&String> = routes.iter().map(|r| &r.0).collect();
    assert_eq!(names.len(), routes.len(), "route names are unique");
    assert!(routes.iter().all(|r| r.3 == "required"));
    let config = config_with(dir, "routes.toml", &toml_text);
    assert_eq!(
        checked(&config).len(),
        written,
        "--check prints every route"
    );

    let (annotated, notes) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        file,
    ]);
    let before = read(doc);
    let after = parse(&annotated);
    let unsafe_ops: BTreeSet<(String, String)> = operations(&before)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|(_, m)| m == "post" || m == "patch")
        .collect();
    assert_eq!(unsafe_ops.len(), selected);
    assert_eq!(summary(&notes), vec![operations_found, selected], "{notes}");
    for (key, op) in operations(&after) {
        if unsafe_ops.contains(&key) {
            assert_protected(&after, &key, &op, true);
        }
    }
    assert_rest_unchanged(&before, &after, &unsafe_ops);
    let ext = doc.extension().unwrap().to_str().unwrap();
    let out = dir.join(format!("annotated.{ext}"));
    std::fs::write(&out, annotated).unwrap();
    out
}

#[test]
fn petstore_round_trip_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "petstore-expanded.yaml");
    let annotated = round(dir.path(), &doc, [4, 1, 1]);
    let text = std::fs::read_to_string(&annotated).unwrap();
    // The output of `routes` alone (no [server]) is a configuration annotate takes.
    let file = doc.to_str().unwrap();
    let (routes, _) = ok(&["openapi", "routes", "--unsafe-methods", file]);
    let bare = dir.path().join("bare.toml");
    std::fs::write(&bare, routes).unwrap();
    let (again, _) = ok(&[
        "openapi",
        "annotate",
        "--config",
        bare.to_str().unwrap(),
        file,
    ]);
    assert_eq!(again, text);
    assert!(!text.trim_start().starts_with('{'), "YAML in, YAML out");
    assert_valid(&[&doc, &annotated]);
}

#[test]
fn stripe_spec3_yaml() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "stripe-spec3.yaml.xz");
    let annotated = round(dir.path(), &doc, [468, 222, 222]);
    assert_valid(&[&annotated]);
}

#[test]
fn github_api_json() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "github-api.github.com.json.xz");
    let annotated = round(dir.path(), &doc, [1223, 263, 262]);
    let text = std::fs::read_to_string(&annotated).unwrap();
    assert!(text.starts_with("{\n"), "JSON in, JSON out");
    let after = parse(&text);
    let protected: BTreeSet<(String, String)> = operations(&after)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|(_, m)| m == "post" || m == "patch")
        .collect();
    let part = protected_part(&after, &protected);
    assert_eq!(
        operations(&part)
            .iter()
            .filter(|(k, _)| protected.contains(k))
            .count(),
        263
    );
    let file = dir.path().join("protected-part.json");
    std::fs::write(&file, serde_json::to_string_pretty(&part).unwrap()).unwrap();
    assert_valid(&[&file]);
}

/// A route for a templated path marks the operation of that template, as
/// the proxy matches a request to it; a literal route does not take a template.
#[test]
fn a_templated_route_marks_its_operation() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "stripe-spec3.yaml.xz");
    let config = config_with(
        dir.path(),
        "two.toml",
        "[[routes]]\nname = \"customers\"\npath = \"/v1/customers\"\n\n\
         [[routes]]\nname = \"customer\"\npath = \"/v1/customers/{id}\"\nkey = \"optional\"\n\n\
         [[routes]]\nname = \"search\"\nmethods = [\"GET\"]\npath = \"/v1/customers/search\"\n",
    );
    let (annotated, notes) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    let before = read(&doc);
    let after = parse(&annotated);
    let post = |p: &str| (p.to_string(), "post".to_string());
    let get = |p: &str| (p.to_string(), "get".to_string());
    let marked: BTreeSet<(String, String)> = [
        post("/v1/customers"),
        post("/v1/customers/{customer}"),
        get("/v1/customers/search"),
    ]
    .into_iter()
    .collect();
    assert_eq!(summary(&notes), vec![468, 3], "{notes}");
    let op = |k: &(String, String)| after["paths"][k.0.as_str()][k.1.as_str()].clone();
    assert_protected(
        &after,
        &post("/v1/customers"),
        &op(&post("/v1/customers")),
        true,
    );
    let templated = post("/v1/customers/{customer}");
    assert_protected(&after, &templated, &op(&templated), false);
    // GET /v1/customers/{customer} is not taken by the literal /v1/customers/search.
    let one = get("/v1/customers/{customer}");
    assert_eq!(op(&one), before["paths"][one.0.as_str()]["get"]);
    assert_rest_unchanged(&before, &after, &marked);
}

/// An OpenAPI 3.1 document written here: `x-idempotency-key` marks, what a
/// 3.1 document gets (`const`, `examples`), a response the operation
/// describes itself kept, a shared 2xx response copied for the replay
/// header, JSON in and JSON out with the order of keys kept.
const DOC_3_1: &str = r##"{
  "openapi": "3.1.0",
  "info": {"title": "Orders", "version": "1"},
  "paths": {
    "/v1/orders": {
      "post": {
        "operationId": "createOrder",
        "x-idempotency-key": "required",
        "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {
          "201": {"$ref": "#/components/responses/Order"},
          "409": {"description": "Our own conflict"}
        }
      },
      "get": {"operationId": "listOrders", "responses": {"200": {"$ref": "#/components/responses/Order"}}}
    },
    "/v1/orders/{order-id}/pay": {
      "parameters": [{"name": "order-id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "post": {
        "operationId": "pay order",
        "x-idempotency-key": "optional",
        "responses": {"200": {"description": "Paid", "content": {"application/json": {"schema": {"type": ["object", "null"]}}}}}
      },
      "patch": {"operationId": "patchOrder", "responses": {"200": {"description": "Patched"}}}
    }
  },
  "components": {
    "responses": {"Order": {"description": "An order", "content": {"application/json": {"schema": {"type": "object"}}}}},
    "schemas": {"IdempotencyProblem": {"type": "string"}}
  }
}
"##;

#[test]
fn an_openapi_3_1_document() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("orders.json");
    std::fs::write(&doc, DOC_3_1).unwrap();
    let file = doc.to_str().unwrap();
    let (toml_text, notes) = ok(&["openapi", "routes", file]);
    assert_eq!(summary(&notes), vec![4, 2, 2], "{notes}");
    let routes = routes_of(&toml_text);
    let expected = [
        ("createOrder", "/v1/orders", "required"),
        ("pay_order", "/v1/orders/{order_id}/pay", "optional"),
    ];
    for (r, (name, path, key)) in routes.iter().zip(expected) {
        assert_eq!(
            (r.0.as_str(), r.1.as_slice(), r.2.as_str(), r.3.as_str()),
            (name, &["POST".to_string()][..], path, key)
        );
    }
    let config = config_with(dir.path(), "orders.toml", &toml_text);
    assert_eq!(checked(&config).len(), 2);
    // With --unsafe-methods the PATCH joins (required: a route of its own).
    let (unsafe_toml, notes) = ok(&["openapi", "routes", "--unsafe-methods", file]);
    assert_eq!(summary(&notes), vec![4, 3, 3], "{notes}");
    assert!(
        unsafe_toml.contains("name = \"patchOrder\""),
        "{unsafe_toml}"
    );

    let (annotated, _) = ok(&[
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        file,
    ]);
    assert!(
        annotated.starts_with("{\n  \"openapi\": \"3.1.0\",\n  \"info\""),
        "{annotated}"
    );
    let before = parse(DOC_3_1);
    let after = parse(&annotated);
    let create = ("/v1/orders".to_string(), "post".to_string());
    let pay = ("/v1/orders/{order-id}/pay".to_string(), "post".to_string());
    assert_protected(&after, &create, &after["paths"]["/v1/orders"]["post"], true);
    assert_protected(&after, &pay, &after["paths"][pay.0.as_str()]["post"], false);
    let protected: BTreeSet<_> = [create, pay].into_iter().collect();
    assert_rest_unchanged(&before, &after, &protected);
    let ops = &after["paths"]["/v1/orders"];
    assert_eq!(
        ops["post"]["responses"]["409"]["description"],
        "Our own conflict"
    );
    assert_eq!(
        ops["post"]["responses"]["201"]["$ref"],
        "#/components/responses/OrderReplayed"
    );
    assert_eq!(
        ops["get"]["responses"]["200"]["$ref"],
        "#/components/responses/Order"
    );
    let components = &after["components"];
    assert!(components["responses"]["Order"]["headers"].is_null());
    // The document's own IdempotencyProblem stays; the proxy's takes another name.
    assert_eq!(
        components["schemas"]["IdempotencyProblem"]["type"],
        "string"
    );
    let problem = &components["schemas"]["IdempotencyProblem2"];
    assert!(
        problem["properties"]["type"]["examples"].is_sequence(),
        "3.1: examples"
    );
    let replayed = &components["headers"]["IdempotentReplayed"]["schema"];
    assert_eq!(replayed["const"], "true", "3.1: const");
    let out = dir.path().join("annotated.json");
    std::fs::write(&out, &annotated).unwrap();
    assert_valid(&[&doc, &out]);
}

#[test]
fn what_is_not_openapi_3_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let swagger = fixture(dir.path(), "petstore-expanded-swagger-2.0.yaml");
    let m = refused(&["openapi", "routes", swagger.to_str().unwrap()]);
    assert!(m.contains("Swagger 2.0") && m.contains("OpenAPI 3"), "{m}");
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "{\"openapi\": \"3.0.0\", \"paths\": ").unwrap();
    let m = refused(&["openapi", "routes", garbage.to_str().unwrap()]);
    assert!(m.contains("not a JSON or YAML document"), "{m}");
    let text = dir.path().join("text.yaml");
    std::fs::write(&text, "just some words\n").unwrap();
    let m = refused(&["openapi", "routes", text.to_str().unwrap()]);
    assert!(m.contains("not a mapping"), "{m}");
    let other = dir.path().join("other.yaml");
    std::fs::write(&other, "title: not an API\n").unwrap();
    let m = refused(&["openapi", "routes", other.to_str().unwrap()]);
    assert!(m.contains("no \"openapi\" field"), "{m}");
    let m = refused(&[
        "openapi",
        "routes",
        dir.path().join("absent.yaml").to_str().unwrap(),
    ]);
    assert!(m.contains("cannot read"), "{m}");
    let webhooks = fixture(dir.path(), "webhook-example-3.1.json");
    let m = refused(&[
        "openapi",
        "routes",
        "--unsafe-methods",
        webhooks.to_str().unwrap(),
    ]);
    assert!(m.contains("no operation selected"), "{m}");
    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, DOC_3_1.replace("\"optional\"", "\"maybe\"")).unwrap();
    let m = refused(&["openapi", "routes", wrong.to_str().unwrap()]);
    assert!(m.contains("x-idempotency-key is \"maybe\""), "{m}");
}

#[test]
fn annotate_refuses_a_bad_configuration_or_one_that_protects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let doc = fixture(dir.path(), "petstore-expanded.yaml");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[routes]]\nname = \"x\"\npath = \"v1\"\n").unwrap();
    let m = refused(&[
        "openapi",
        "annotate",
        "--config",
        bad.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    assert!(
        m.contains("invalid configuration") && m.contains("routes[0].path"),
        "{m}"
    );
    let elsewhere = dir.path().join("elsewhere.toml");
    std::fs::write(
        &elsewhere,
        "[[routes]]\nname = \"x\"\npath = \"/v1/payments\"\n",
    )
    .unwrap();
    let m = refused(&[
        "openapi",
        "annotate",
        "--config",
        elsewhere.to_str().unwrap(),
        doc.to_str().unwrap(),
    ]);
    assert!(m.contains("none of its 4 operations is protected"), "{m}");
}

/// Webhook receivers: a key from another header and one from the JSON
/// body; a YAML document on standard input with an anchor, merge keys and
/// status codes written as numbers.
#[test]
fn keys_from_another_header_or_the_body() {
    const HOOKS: &str = "openapi: 3.0.3
info: {title: Hooks, version: '1'}
x-common: &common
  responses:
    200: {description: Done}
paths:
  /hooks/github:
    post:
      <<: *common
      operationId: github
  /hooks/stripe:
    post:
      <<: *common
      operationId: stripe
      requestBody: {content: {application/json: {schema: {type: object}}}}
";
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hooks.toml");
    std::fs::write(
        &config,
        "[server]\nupstream = \"http://127.0.0.1:3000\"\n\n\
         [[routes]]\nname = \"github\"\npath = \"/hooks/github\"\nkey_from = \"header:X-GitHub-Delivery\"\n\n\
         [[routes]]\nname = \"stripe\"\npath = \"/hooks/stripe\"\nkey_from = \"json:/id\"\n",
    )
    .unwrap();
    let args = [
        "openapi",
        "annotate",
        "--config",
        config.to_str().unwrap(),
        "-",
    ];
    let text = ok_with_input(&args, HOOKS);
    let doc = parse(&text);
    let github = &doc["paths"]["/hooks/github"]["post"];
    let stripe = &doc["paths"]["/hooks/stripe"]["post"];
    let reference = github["parameters"][0]["$ref"].as_str().unwrap();
    let name = reference.rsplit('/').next().unwrap();
    let parameter = &doc["components"]["parameters"][name];
    assert_eq!(parameter["name"], "X-Github-Delivery", "{text}");
    assert!(
        stripe.get("parameters").is_none(),
        "a key in the body has no parameter"
    );
    let bad = response(&doc, &stripe["responses"]["400"]);
    let examples = &bad["content"]["application/problem+json"]["examples"];
    let missing = &examples["idempotency-key-missing"]["value"];
    assert_eq!(missing["idempotency_key"]["json_pointer"], "/id", "{text}");
    for op in [github, stripe] {
        let ok = &op["responses"][200];
        assert!(ok["headers"]["Idempotent-Replayed"].is_mapping(), "{text}");
        assert!(has_status(&op["responses"], 409));
    }
    assert!(!text.contains("<<"), "merge keys applied");
    let file = dir.path().join("hooks.yaml");
    std::fs::write(&file, &text).unwrap();
    assert_valid(&[&file]);
}
