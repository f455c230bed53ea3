//! `campaign`: a randomized fault campaign against idemproxy.

mod check;
mod history;
mod timeline;

fn main() {}
