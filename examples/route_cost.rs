//! What judging a request against the routes costs (`RouteTable::judge`):
//! nanoseconds per request for the requests a proxy mostly sees — a
//! protected path as clients write it, pass-through GETs and POSTs — and for
//! the spellings only a hostile or unusual client sends (dot segments,
//! escapes, a format suffix, a method override). Six routes, as in
//! `config/idemproxy.toml`.
//!
//!     cargo run --release --example route_cost

use std::time::Instant;

use http::{HeaderMap, HeaderValue, Method, Uri};
use idemproxy::config::{Config, Overrides};

const ROUNDS: u32 = 1_000_000;

const ROUTES: &str = r#"
[server]
upstream = "http://127.0.0.1:3000"

[[routes]]
name = "payments"
path = "/v1/payments"

[[routes]]
name = "refunds"
methods = ["POST", "PUT"]
path = "/v1/payments/{id}/refunds"

[[routes]]
name = "pay"
path = "/v1/orders/{id}/pay"

[[routes]]
name = "update"
methods = ["PATCH"]
path = "/v1/orders/{id}"

[[routes]]
name = "orders"
path = "/v1/orders/*"

[[routes]]
name = "report"
path = "/v1/report"
format_suffix = false
"#;

fn main() {
    let config = Config::from_toml(ROUTES, "route_cost.toml", &Overrides::default())
        .expect("the example's routes");
    let none = HeaderMap::new();
    let mut overridden = HeaderMap::new();
    overridden.insert("x-http-method-override", HeaderValue::from_static("PATCH"));
    let cases: [(&str, Method, &str, &HeaderMap); 9] = [
        ("protected, as written", Method::POST, "/v1/payments", &none),
        (
            "protected {id}",
            Method::POST,
            "/v1/payments/pay_123/refunds",
            &none,
        ),
        (
            "pass-through GET",
            Method::GET,
            "/v1/payments/pay_123?expand=charges",
            &none,
        ),
        (
            "pass-through POST",
            Method::POST,
            "/v1/customers/cus_9/notes",
            &none,
        ),
        (
            "dot segment as {id}",
            Method::POST,
            "/v1/orders/./pay",
            &none,
        ),
        (
            "escapes, broad pass",
            Method::POST,
            "/V1%2Fpayments;x=1",
            &none,
        ),
        ("format suffix", Method::POST, "/v1/payments.json", &none),
        ("method override", Method::POST, "/v1/orders/7", &overridden),
        ("control character", Method::POST, "/v1/payments%0a", &none),
    ];
    println!("{:<24} {:>10}  judgement", "request", "ns each");
    for (name, method, target, headers) in cases {
        let uri: Uri = target.parse().expect("a target");
        let judged = config.routes.judge(&method, &uri, headers);
        let start = Instant::now();
        for _ in 0..ROUNDS {
            std::hint::black_box(config.routes.judge(
                std::hint::black_box(&method),
                std::hint::black_box(&uri),
                headers,
            ));
        }
        let ns = start.elapsed().as_nanos() as f64 / f64::from(ROUNDS);
        println!("{name:<24} {ns:>10.1}  {judged:?}");
    }
}
