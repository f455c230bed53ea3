//! An image reference as registries and the kubelet read it, checked before
//! it is written into a Pod: one they refuse would leave every injected Pod
//! in `InvalidImageName`.

/// `[HOST[:PORT]/]PATH[:TAG][@ALGORITHM:DIGEST]`: the host (the first
/// component when it has a dot, a port or an upper-case letter, is
/// `localhost`, or is an IPv6 address in brackets), path components
/// lower-case (`a-z0-9` joined by `.`, `_`, `__` or dashes), the name at
/// most 255 characters, a tag of at most 128, and a digest the kubelet
/// knows: `sha256`, `sha384` or `sha512` with 64, 96 or 128 lower-case hex
/// digits.
pub fn check_image(image: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("not an image reference ({why})"));
    if image.len() > 4096 {
        return bad("longer than 4,096 characters");
    }
    let (name, digest) = match image.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (image, None),
    };
    if let Some(digest) = digest {
        let digits = match digest.split_once(':') {
            Some(("sha256", hex)) => (hex, 64),
            Some(("sha384", hex)) => (hex, 96),
            Some(("sha512", hex)) => (hex, 128),
            _ => return bad("a digest is sha256:, sha384: or sha512: and its hex digits"),
        };
        let (hex, length) = digits;
        if hex.len() != length || !hex.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')) {
            return bad("a sha256 digest is 64 lower-case hex digits (sha384 96, sha512 128)");
        }
    }
    let last_slash = name.rfind('/').map_or(0, |i| i + 1);
    let (path, tag) = match name[last_slash..].rfind(':') {
        Some(i) => (&name[..last_slash + i], Some(&name[last_slash + i + 1..])),
        None => (name, None),
    };
    if let Some(tag) = tag {
        let first_ok = tag.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        let rest_ok = tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if tag.is_empty() || tag.len() > 128 || !first_ok || !rest_ok {
            return bad("a tag is 1 to 128 of A-Z a-z 0-9 _ . - and starts with neither . nor -");
        }
    }
    if path.len() > 255 {
        return bad("a name is at most 255 characters");
    }
    let mut components: Vec<&str> = path.split('/').collect();
    let host = components.first().copied().unwrap_or_default();
    let is_host = host.contains(['.', ':'])
        || host == "localhost"
        || host.starts_with('[')
        || host.chars().any(|c| c.is_ascii_uppercase());
    if components.len() > 1 && host.starts_with('[') {
        // An IPv6 registry: `[address]` or `[address]:port`.
        let (address, port) = match host.split_once("]:") {
            Some((address, port)) => (address.trim_start_matches('['), Some(port)),
            None => (host.trim_start_matches('[').trim_end_matches(']'), None),
        };
        let address_ok = host.contains(']') && address.parse::<std::net::Ipv6Addr>().is_ok();
        if !address_ok
            || port.is_some_and(|p| p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()))
        {
            return bad("the registry is HOST, HOST:PORT, [IPv6] or [IPv6]:PORT");
        }
        components.remove(0);
    } else if components.len() > 1 && is_host {
        let (domain, port) = match host.split_once(':') {
            Some((domain, port)) => (domain, Some(port)),
            None => (host, None),
        };
        let label_ok = |l: &str| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if !domain.split('.').all(label_ok)
            || port.is_some_and(|p| p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()))
        {
            return bad("the registry is HOST or HOST:PORT");
        }
        components.remove(0);
    }
    for c in components {
        if !path_component(c) {
            return bad("a path component is lower-case a-z 0-9, joined by . _ __ or -");
        }
    }
    Ok(())
}

fn path_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator: `.`, `_`, `__` or a run of dashes, between alphanumerics.
        let start = i;
        match b[i] {
            b'.' => i += 1,
            b'_' => i += if b.get(i + 1) == Some(&b'_') { 2 } else { 1 },
            b'-' => {
                while b.get(i) == Some(&b'-') {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i == start || i >= b.len() || !alnum(b[i]) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_registries_take_and_what_they_refuse() {
        let digest = format!("sha256:{}", "a".repeat(64));
        for good in [
            "nginx".to_string(),
            "nginx:1.27".to_string(),
            "library/nginx:1.27-alpine".to_string(),
            "ghcr.io/idemproxy/idemproxy:0.1.0".to_string(),
            "registry.example.com:5000/team/idem_proxy__x/a-b--c:v1".to_string(),
            "localhost/x:1".to_string(),
            "[::1]:5000/x:1".to_string(),
            "[fd00::1]/team/x:1".to_string(),
            "Registry/x:1".to_string(),
            format!("x@sha512:{}", "b".repeat(128)),
            "Registry.Example.com/x/y:1".to_string(),
            format!("ghcr.io/idemproxy/idemproxy:0.1.0@{digest}"),
            format!("ghcr.io/idemproxy/idemproxy@{digest}"),
            format!("x:{}", "t".repeat(128)),
        ] {
            assert_eq!(check_image(&good), Ok(()), "{good}");
        }
        for bad in [
            "".to_string(),
            "bad image $(x)".to_string(),
            "reg.example.com/x/IdemProxy:1.0".to_string(),
            "reg.example.com/x/..:1".to_string(),
            "reg.example.com/x/y:.bad".to_string(),
            "reg.example.com/x/y:-bad".to_string(),
            "reg.example.com//y:1".to_string(),
            "reg.example.com/x/y:".to_string(),
            "x/y_:1".to_string(),
            "x/y___z:1".to_string(),
            "x\"y".to_string(),
            "x/y:1\nimage: evil".to_string(),
            format!("x:{}", "t".repeat(129)),
            "x@sha256:abc".to_string(),
            format!("x@sha256:{}", "a".repeat(32)),
            format!("x@sha256:{}", "A".repeat(64)),
            format!("x@md5:{}", "a".repeat(32)),
            format!("x@sha256:{}", "a".repeat(128)),
            format!("reg.io/{}:1", "a".repeat(300)),
            "[::1:5000/x:1".to_string(),
            "[nothost]:5000/x:1".to_string(),
            "-reg.io/x:1".to_string(),
            "reg.io:port/x:1".to_string(),
        ] {
            assert!(check_image(&bad).is_err(), "{bad:?}");
        }
    }
}
