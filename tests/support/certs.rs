//! Certificates made with `openssl` at test time: a CA, and server certificates it signs
//! for 127.0.0.1 and localhost (for `rediss://` and the proxy's own TLS listener).

use std::path::Path;
use std::process::Command;

/// Runs openssl in `dir` with whitespace-separated arguments (none of them contains a space).
pub fn openssl(dir: &Path, args: &str) {
    let args: Vec<&str> = args.split_whitespace().collect();
    let out = Command::new("openssl")
        .args(&args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA in `dir`: `<name>.key` and `<name>.pem`, with the common name `name`.
pub fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &format!("ecparam -name prime256v1 -genkey -noout -out {name}.key"),
    );
    openssl(
        dir,
        &format!(
            "req -x509 -new -key {name}.key -out {name}.pem -days 2 -subj /CN={name} \
             -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign"
        ),
    );
}

/// A server certificate for 127.0.0.1 and localhost signed by the CA `ca`:
/// `<name>.key` and `<name>.pem`, with the common name `cn`. Each one the CA
/// signs has a serial of its own.
pub fn make_server_cert(dir: &Path, ca: &str, name: &str, cn: &str) {
    openssl(
        dir,
        &format!("ecparam -name prime256v1 -genkey -noout -out {name}.key"),
    );
    openssl(
        dir,
        &format!("req -new -key {name}.key -out {name}.csr -subj /CN={cn}"),
    );
    std::fs::write(
        dir.join(format!("{name}.ext")),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &format!(
            "x509 -req -in {name}.csr -CA {ca}.pem -CAkey {ca}.key -CAcreateserial \
             -out {name}.pem -days 2 -extfile {name}.ext"
        ),
    );
}

/// A CA and a server certificate for 127.0.0.1: `ca.pem`, `server.pem`, `server.key`.
pub fn make_certs(dir: &Path) {
    make_ca(dir, "ca");
    make_server_cert(dir, "ca", "server", "127.0.0.1");
}
