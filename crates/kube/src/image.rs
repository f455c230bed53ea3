//! An image reference as registries and the kubelet read it, checked before
//! it is written into a Pod: one they refuse would leave every injected Pod
//! in `InvalidImageName`.

/// `[HOST[:PORT]/]PATH[:TAG][@ALGORITHM:DIGEST]`: the host (its first
/// component when it has a dot or a port, or is `localhost`) in any case,
/// path components lower-case (`a-z0-9` joined by `.`, `_`, `__` or dashes),
/// a tag of at most 128 characters, a digest of at least 32 hex digits.
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
        let Some((algorithm, hex)) = digest.split_once(':') else {
            return bad("a digest is ALGORITHM:HEX");
        };
        let algorithm_ok = algorithm.split(['+', '.', '_', '-']).all(|part| {
            part.starts_with(|c: char| c.is_ascii_alphabetic())
                && part.chars().all(|c| c.is_ascii_alphanumeric())
        });
        if !algorithm_ok || hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return bad("a digest is ALGORITHM:HEX, as sha256:<64 hex digits>");
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
    let mut components: Vec<&str> = path.split('/').collect();
    let host = components.first().copied().unwrap_or_default();
    if components.len() > 1 && (host.contains(['.', ':']) || host == "localhost") {
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
            "-reg.io/x:1".to_string(),
            "reg.io:port/x:1".to_string(),
        ] {
            assert!(check_image(&bad).is_err(), "{bad:?}");
        }
    }
}
