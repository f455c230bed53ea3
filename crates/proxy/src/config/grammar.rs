//! The value grammar of the configuration file: durations, sizes, methods, header names, statuses, route paths.
//!
//! Each type parses while the file is read, so a bad value fails with the
//! span of the value itself.

use std::fmt;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::policy::Pointer;
use crate::routes::PathPattern;

/// A duration written as `"250ms"`, `"30s"`, `"1m30s"`, `"24h"`, `"7d"`; always greater than zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub fn parse(text: &str) -> Result<Self, String> {
        let s = text.trim();
        if s.is_empty() {
            return Err("empty duration; write e.g. \"30s\" or \"250ms\"".into());
        }
        let mut total: u128 = 0;
        let mut rest = s;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return Err(format!("invalid duration \"{text}\": expected a number before {rest:?} (units: ms, s, m, h, d)"));
            }
            let number: u128 = rest[..digits]
                .parse()
                .map_err(|_| format!("invalid duration \"{text}\": number too large"))?;
            rest = &rest[digits..];
            let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
            let unit = &rest[..unit_len];
            rest = &rest[unit_len..];
            let ms_per_unit: u128 = match unit {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                "d" => 86_400_000,
                "" => {
                    return Err(format!(
                        "invalid duration \"{text}\": a unit is required (ms, s, m, h, d)"
                    ))
                }
                other => {
                    return Err(format!(
                    "invalid duration \"{text}\": unknown unit \"{other}\" (units: ms, s, m, h, d)"
                ))
                }
            };
            total = total
                .checked_add(number.saturating_mul(ms_per_unit))
                .ok_or_else(|| format!("invalid duration \"{text}\": too large"))?;
        }
        if total == 0 {
            return Err(format!(
                "invalid duration \"{text}\": must be greater than zero"
            ));
        }
        let ms =
            u64::try_from(total).map_err(|_| format!("invalid duration \"{text}\": too large"))?;
        Ok(HumanDuration(Duration::from_millis(ms)))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DurationVisitor)
    }
}

/// A duration is a string with units; a bare number is refused with what to write instead.
struct DurationVisitor;

impl de::Visitor<'_> for DurationVisitor {
    type Value = HumanDuration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration string such as \"250ms\", \"30s\" or \"24h\"")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<HumanDuration, E> {
        HumanDuration::parse(s).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<HumanDuration, E> {
        Err(E::custom(format!(
            "invalid duration {n}: a duration is a string with a unit, e.g. \"{n}s\" or \"{n}ms\" (units: ms, s, m, h, d)"
        )))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<HumanDuration, E> {
        Err(E::custom(format!(
            "invalid duration {n}: a duration is a string with a unit, e.g. \"{n}s\" or \"{n}ms\" (units: ms, s, m, h, d)"
        )))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<HumanDuration, E> {
        Err(E::custom(format!(
            "invalid duration {n}: a duration is a string with a unit, e.g. \"1m30s\" or \"1500ms\" (units: ms, s, m, h, d)"
        )))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        // Hours at most: "48h" reads better than "2d" next to a config that says "48h".
        for (unit, size) in [("h", 3_600_000u128), ("m", 60_000), ("s", 1_000)] {
            if ms % size == 0 {
                return write!(f, "{}{unit}", ms / size);
            }
        }
        write!(f, "{ms}ms")
    }
}

/// A size in bytes: an integer, or a string such as `"64KiB"`, `"1MB"`, `"1000"`; greater than zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(text: &str) -> Result<Self, String> {
        let s = text.trim();
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "invalid size \"{text}\": expected a number of bytes or e.g. \"64KiB\""
            ));
        }
        let number: u64 = s[..digits]
            .parse()
            .map_err(|_| format!("invalid size \"{text}\": number too large"))?;
        let multiplier: u64 = match s[digits..].trim() {
            "" | "B" => 1,
            "KB" => 1_000,
            "KiB" => 1 << 10,
            "MB" => 1_000_000,
            "MiB" => 1 << 20,
            "GB" => 1_000_000_000,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "invalid size \"{text}\": unknown unit \"{other}\" (units: B, KB, KiB, MB, MiB, GB, GiB)"
                ))
            }
        };
        let bytes = number
            .checked_mul(multiplier)
            .ok_or_else(|| format!("invalid size \"{text}\": too large"))?;
        if bytes == 0 {
            return Err(format!(
                "invalid size \"{text}\": must be greater than zero"
            ));
        }
        Ok(ByteSize(bytes))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) if n > 0 => Ok(ByteSize(n as u64)),
            Raw::Int(n) => Err(de::Error::custom(format!(
                "invalid size {n}: must be greater than zero"
            ))),
            Raw::Text(s) => ByteSize::parse(&s).map_err(de::Error::custom),
        }
    }
}

/// An HTTP method parsed at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConfMethod(pub Method);

impl<'de> Deserialize<'de> for ConfMethod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let upper = s.to_ascii_uppercase();
        if upper.is_empty() || !upper.bytes().all(|b| b.is_ascii_alphabetic() || b == b'-') {
            return Err(de::Error::custom(format!("invalid HTTP method \"{s}\"")));
        }
        Method::from_bytes(upper.as_bytes())
            .map(ConfMethod)
            .map_err(|_| de::Error::custom(format!("invalid HTTP method \"{s}\"")))
    }
}

/// A header name parsed (and lower-cased) at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConfHeader(pub HeaderName);

impl<'de> Deserialize<'de> for ConfHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
            .map(ConfHeader)
            .map_err(|_| de::Error::custom(format!("invalid header name \"{s}\"")))
    }
}

/// `key_from` as written: `"header"` (the route's `header`), `"header:<Name>"` or `"json:<pointer>"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ConfKeyFrom {
    /// The route's `header`, whatever it resolves to.
    RouteHeader,
    Header(HeaderName),
    Json(Pointer),
}

impl ConfKeyFrom {
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "header" {
            return Ok(ConfKeyFrom::RouteHeader);
        }
        if let Some(name) = text.strip_prefix("header:") {
            if name.is_empty() {
                return Err(
                    "\"header:\" names no header; write e.g. \"header:X-GitHub-Delivery\"".into(),
                );
            }
            return HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                .map(ConfKeyFrom::Header)
                .map_err(|_| format!("invalid header name \"{name}\""));
        }
        if let Some(pointer) = text.strip_prefix("json:") {
            return Pointer::parse(pointer).map(ConfKeyFrom::Json);
        }
        Err(format!(
            "invalid key source \"{text}\": expected \"header\", \"header:<Name>\" or \"json:<pointer>\""
        ))
    }
}

impl<'de> Deserialize<'de> for ConfKeyFrom {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ConfKeyFrom::parse(&s).map_err(de::Error::custom)
    }
}

/// An HTTP status code from 100 to 599.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConfStatus(pub u16);

impl<'de> Deserialize<'de> for ConfStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        if (100..=599).contains(&n) {
            Ok(ConfStatus(n as u16))
        } else {
            Err(de::Error::custom(format!(
                "invalid HTTP status {n}: expected 100..=599"
            )))
        }
    }
}

/// A gRPC status code, 0..=16.
#[derive(Debug)]
pub(crate) struct ConfGrpcStatus(pub u32);

impl<'de> Deserialize<'de> for ConfGrpcStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i64::deserialize(d)?;
        if (0..=16).contains(&n) {
            Ok(ConfGrpcStatus(n as u32))
        } else {
            Err(de::Error::custom(format!(
                "invalid gRPC status {n}: expected 0..=16"
            )))
        }
    }
}

impl<'de> Deserialize<'de> for PathPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathPattern::parse(&s).map_err(de::Error::custom)
    }
}
