//! Records sealed at rest (docs/reference/store.md#sealing): the key file, and AES-256-GCM over
//! the part
//! of a record that holds the answer (ring's implementation; no crypto here).
//!
//! The key file (`[store] encryption_key_file`) has one key per line,
//! `<key id>:<base64 of 32 bytes>`. The first key seals new records; every key
//! opens them, so a rotation adds a new first line and keeps the old ones
//! until their records have expired. Blank lines and lines starting with `#`
//! are skipped; spaces and tabs around a line or its two parts are ignored,
//! and so are CRLF line ends. A key id is 1 to 64 characters of `A-Z a-z 0-9
//! . _ -` and may appear once; the key is standard base64 (padding optional).
//!
//! No message quotes the file: a line that is wrong is named by its number
//! only, since it may hold a key. The file is read at start and on SIGHUP
//! ([`Sealing::reload`]); a reload that fails keeps the keys in use.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

/// The configuration key, as messages name it.
const KEY_FILE: &str = "store.encryption_key_file";
/// The bytes of the GCM tag that follows a sealed text.
pub(crate) const TAG_LEN: usize = 16;
/// The bytes of a nonce, stored beside the sealed text.
pub(crate) const NONCE_BYTES: usize = NONCE_LEN;
/// The longest key id.
pub(crate) const MAX_KEY_ID: usize = 64;

/// Standard base64, with or without the trailing `=` (both are common).
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file cannot be read (not mounted, no permission): a start-up failure.
    #[error("cannot read {KEY_FILE} {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// A line is wrong: a configuration error. The line is never quoted.
    #[error("{path}:{line}: {KEY_FILE}: {message}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// The file as a whole is wrong (it holds no key).
    #[error("{path}: {KEY_FILE}: {message}")]
    File {
        path: PathBuf,
        message: &'static str,
    },
}

impl KeyFileError {
    /// The file was read and is wrong (exit 2), as opposed to not readable (exit 1).
    pub fn is_configuration(&self) -> bool {
        !matches!(self, KeyFileError::Read { .. })
    }
}

/// Why a sealed text did not open.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenError {
    /// No key of the file has this id.
    UnknownKey,
    /// The key is there, but the text, its nonce or its associated data differ
    /// from what was sealed (altered, or copied from another record).
    Rejected,
}

/// The random number generator failed: nothing can be sealed.
#[derive(Debug, thiserror::Error)]
#[error("no random nonce could be drawn for sealing")]
pub struct SealError;

struct Key {
    id: String,
    key: LessSafeKey,
}

/// The keys of one reading of the key file, in file order (the first seals).
pub struct Keyring {
    keys: Vec<Key>,
    rng: SystemRandom,
}

/// Key ids only: never the keys.
impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

/// The most keys a key file may hold: each record's key is looked up among them.
pub(crate) const MAX_KEYS: usize = 1000;

/// A key id: 1 to [`MAX_KEY_ID`] bytes of `A-Z a-z 0-9 . _ -`.
pub(crate) fn valid_key_id(id: &[u8]) -> bool {
    (1..=MAX_KEY_ID).contains(&id.len())
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Keyring {
    /// Reads and parses the key file.
    pub fn load(path: &Path) -> Result<Keyring, KeyFileError> {
        let text =
            crate::files::read_regular(path, crate::files::SMALL_FILE_LIMIT).map_err(|source| {
                KeyFileError::Read {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
        Keyring::parse(path, &text)
    }

    /// Parses the text of the key file (`path` is for messages only).
    pub fn parse(path: &Path, text: &[u8]) -> Result<Keyring, KeyFileError> {
        let text = text.strip_prefix(b"\xef\xbb\xbf").unwrap_or(text);
        let mut keys: Vec<Key> = Vec::new();
        // Each id's line: a duplicate is found in one look-up.
        let mut lines: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (n, line) in text.split(|&b| b == b'\n').enumerate() {
            let line = line.trim_ascii();
            if line.is_empty() || line.starts_with(b"#") {
                continue;
            }
            let wrong = |message: String| KeyFileError::Line {
                path: path.to_path_buf(),
                line: n + 1,
                message,
            };
            let key = parse_line(line).map_err(wrong)?;
            if let Some(first) = lines.get(&key.id) {
                return Err(wrong(format!(
                    "this key id is already used on line {first}"
                )));
            }
            if keys.len() == MAX_KEYS {
                return Err(wrong(format!(
                    "more than {MAX_KEYS} keys (a rotation needs two or three)"
                )));
            }
            lines.insert(key.id.clone(), n + 1);
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(KeyFileError::File {
                path: path.to_path_buf(),
                message: "holds no key (expected lines <key id>:<base64 of 32 bytes>)",
            });
        }
        Ok(Keyring {
            keys,
            rng: SystemRandom::new(),
        })
    }

    /// The key ids, in file order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| k.id.as_str())
    }

    /// The id of the key that seals new records (the file's first).
    pub fn sealing_id(&self) -> &str {
        &self.keys[0].id
    }

    /// Seals `in_out` in place with the first key and a fresh random nonce;
    /// returns the nonce and the tag, which go beside the sealed text.
    pub fn seal(
        &self,
        aad: &[u8],
        in_out: &mut [u8],
    ) -> Result<([u8; NONCE_BYTES], [u8; TAG_LEN]), SealError> {
        let mut nonce = [0u8; NONCE_BYTES];
        self.rng.fill(&mut nonce).map_err(|_| SealError)?;
        let tag = self.keys[0]
            .key
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), in_out)
            .map_err(|_| SealError)?;
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(tag.as_ref());
        Ok((nonce, t))
    }

    /// Opens, in place, a text sealed under key `id` (the text followed by its
    /// tag); returns the opened text, a prefix of `in_out`.
    pub fn open<'a>(
        &self,
        id: &str,
        nonce: [u8; NONCE_BYTES],
        aad: &[u8],
        in_out: &'a mut [u8],
    ) -> Result<&'a mut [u8], OpenError> {
        let key = self
            .keys
            .iter()
            .find(|k| k.id == id)
            .ok_or(OpenError::UnknownKey)?;
        key.key
            .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(aad), in_out)
            .map_err(|_| OpenError::Rejected)
    }
}

/// One line: `<key id>:<base64 of 32 bytes>`. The message never quotes it.
fn parse_line(line: &[u8]) -> Result<Key, String> {
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or("expected <key id>:<base64 of 32 bytes>")?;
    let (id, key) = (line[..colon].trim_ascii(), line[colon + 1..].trim_ascii());
    if !valid_key_id(id) {
        return Err(format!(
            "the key id must be 1 to {MAX_KEY_ID} characters of A-Z a-z 0-9 . _ -"
        ));
    }
    let bytes = BASE64
        .decode(key)
        .map_err(|_| "the key is not valid base64".to_string())?;
    if bytes.len() != 32 {
        return Err(format!(
            "the key is {} bytes; AES-256 needs 32 (e.g. head -c 32 /dev/urandom | base64)",
            bytes.len()
        ));
    }
    let key = UnboundKey::new(&AES_256_GCM, &bytes)
        .map_err(|_| "the key is not a valid AES-256 key".to_string())?;
    Ok(Key {
        // Checked above: ASCII.
        id: String::from_utf8_lossy(id).into_owned(),
        key: LessSafeKey::new(key),
    })
}

/// For `--check`: the file's format is checked when it can be read. An
/// unreadable file is a warning (returned), not an error, since the check may
/// run where the secrets are not mounted; a malformed one is an error.
pub fn check(path: &Path) -> Result<Result<Keyring, String>, KeyFileError> {
    match Keyring::load(path) {
        Ok(keys) => Ok(Ok(keys)),
        Err(e @ KeyFileError::Read { .. }) => Ok(Err(format!("{e} (it is read at start)"))),
        Err(e) => Err(e),
    }
}

/// The keys in use, and where they come from: swapped whole on reload, so a
/// record is sealed or opened with one reading of the file.
pub struct Sealing {
    path: PathBuf,
    current: ArcSwap<Keyring>,
}

impl Sealing {
    pub fn load(path: &Path) -> Result<Sealing, KeyFileError> {
        Ok(Sealing {
            path: path.to_path_buf(),
            current: ArcSwap::from_pointee(Keyring::load(path)?),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn keys(&self) -> Arc<Keyring> {
        self.current.load_full()
    }

    /// Reads the file again; a file that cannot be read or is wrong changes nothing.
    pub fn reload(&self) -> Result<Arc<Keyring>, KeyFileError> {
        let keys = Arc::new(Keyring::load(&self.path)?);
        self.current.store(keys.clone());
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="; // bytes 0..32
    const K2: &str = "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8"; // bytes 32..64, unpadded

    fn parse(text: &str) -> Result<Keyring, KeyFileError> {
        Keyring::parse(Path::new("keys"), text.as_bytes())
    }

    #[test]
    fn a_file_of_more_than_max_keys_is_refused_and_duplicates_are_found_in_large_ones() {
        let lines = |n: usize| (0..n).map(|i| format!("k{i}:{K1}\n")).collect::<String>();
        assert_eq!(parse(&lines(MAX_KEYS)).unwrap().ids().count(), MAX_KEYS);
        let (line, message) = line_error(&lines(MAX_KEYS + 1));
        assert_eq!(line, MAX_KEYS + 1);
        assert!(message.contains("more than 1000 keys"), "{message}");
        let dup = format!("{}k7:{K2}\n", lines(MAX_KEYS - 1));
        assert_eq!(
            line_error(&dup),
            (
                MAX_KEYS,
                "this key id is already used on line 8".to_string()
            )
        );
    }

    fn line_error(text: &str) -> (usize, String) {
        match parse(text) {
            Err(KeyFileError::Line { line, message, .. }) => (line, message),
            other => panic!("expected a line error, got {other:?}"),
        }
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let text = format!("# keys\r\n\r\n  new : {K2}  \r\nold:{K1}\r\n");
        let ring = parse(&text).unwrap();
        assert_eq!(ring.ids().collect::<Vec<_>>(), ["new", "old"]);
        assert_eq!(ring.sealing_id(), "new");
        let mut text = b"the answer".to_vec();
        let (nonce, tag) = ring.seal(b"id-1", &mut text).unwrap();
        assert_ne!(&text[..], b"the answer");
        text.extend_from_slice(&tag);
        let mut copy = text.clone();
        assert_eq!(
            ring.open("new", nonce, b"id-1", &mut copy).unwrap(),
            b"the answer"
        );
        // Another id, another nonce, another key, or an altered byte: nothing opens.
        let mut copy = text.clone();
        assert_eq!(
            ring.open("new", nonce, b"id-2", &mut copy),
            Err(OpenError::Rejected)
        );
        let mut copy = text.clone();
        assert_eq!(
            ring.open("old", nonce, b"id-1", &mut copy),
            Err(OpenError::Rejected)
        );
        let mut copy = text.clone();
        assert_eq!(
            ring.open("gone", nonce, b"id-1", &mut copy),
            Err(OpenError::UnknownKey)
        );
        let mut copy = text.clone();
        copy[0] ^= 1;
        assert_eq!(
            ring.open("new", nonce, b"id-1", &mut copy),
            Err(OpenError::Rejected)
        );
        let mut other = nonce;
        other[0] ^= 1;
        let mut copy = text.clone();
        assert!(ring.open("new", other, b"id-1", &mut copy).is_err());
        // A fresh nonce every time.
        let (again, _) = ring.seal(b"id-1", &mut b"the answer".to_vec()).unwrap();
        assert_ne!(again, nonce);
    }

    #[test]
    fn wrong_lines_are_named_by_number_and_never_quoted() {
        let cases = [
            (format!("k1:{K1}\nno colon {K2}\n"), 2, "expected"),
            (format!("\n\nbad id!:{K1}\n"), 3, "key id"),
            (format!(":{K1}\n"), 1, "key id"),
            (format!("{}:{K1}\n", "x".repeat(65)), 1, "key id"),
            (format!("k1:{K1}\nk2:{}\n", &K2[..20]), 2, "bytes"),
            (format!("k1:{K1}=\n"), 1, "base64"),
            (format!("k1:{}*\n", &K1[..43]), 1, "base64"),
            (format!("k1:{K1}\n# c\nk1:{K2}\n"), 3, "line 1"),
            ("k1:\n".to_string(), 1, "0 bytes"),
        ];
        for (text, line, says) in cases {
            let (at, message) = line_error(&text);
            assert_eq!(at, line, "{text:?}: {message}");
            assert!(message.contains(says), "{text:?}: {message}");
            for secret in [K1, &K1[..20], &K2[..20]] {
                assert!(!message.contains(secret), "{message}");
            }
        }
        let e = parse("# only a comment\n\n").unwrap_err();
        assert!(matches!(e, KeyFileError::File { .. }), "{e:?}");
        assert!(e.is_configuration());
        let shown = format!("{:?}", parse(&format!("k1:{K1}")).unwrap());
        assert!(shown.contains("k1") && !shown.contains(K1), "{shown}");
    }

    #[test]
    fn an_unreadable_file_is_a_start_failure_and_only_a_warning_for_check() {
        let missing = Path::new("/nonexistent/idemproxy/keys");
        let e = Keyring::load(missing).unwrap_err();
        assert!(!e.is_configuration());
        let warned = check(missing).unwrap().unwrap_err();
        assert!(warned.contains("/nonexistent/idemproxy/keys"), "{warned}");
    }

    #[test]
    fn a_reload_that_fails_keeps_the_keys_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, format!("one:{K1}\n")).unwrap();
        let sealing = Sealing::load(&path).unwrap();
        std::fs::write(&path, "one:short\n").unwrap();
        assert!(sealing.reload().is_err());
        assert_eq!(sealing.keys().sealing_id(), "one");
        std::fs::write(&path, format!("two:{K2}\none:{K1}\n")).unwrap();
        sealing.reload().unwrap();
        assert_eq!(sealing.keys().sealing_id(), "two");
    }
}
