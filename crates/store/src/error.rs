//! The store's errors: an operation's, and the setup's.

use std::time::Duration;

use crate::record::DecodeError;
use crate::seal::KeyFileError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
    #[error("store error: {0}")]
    Backend(String),
    /// The connection is broken, refused, or reaches a master that is no longer one.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// `wait_replicas` was not met: the reservation was withdrawn.
    #[error("reservation reached {acked} of {wanted} replicas in time")]
    NotReplicated { wanted: u32, acked: u32 },
    /// The reservation was written, but `WAIT` failed (e.g. the ACL lacks `+wait`):
    /// it must be released by its token and the request not forwarded.
    #[error("reservation written, but its replication could not be confirmed: {0}")]
    Unconfirmed(String),
    /// The store answered something no record the proxy wrote could give
    /// (a length over any record, more bytes than asked for, a reply beyond
    /// the reader's bounds or malformed): the key may be
    /// taken, so the request is never forwarded unprotected.
    #[error("the store's answer is not believed: {0}")]
    Untrue(String),
    /// The reserve found the key taken, then failed to read what holds it
    /// (its length, or in time): the operation may have run, or be running,
    /// so the request is never forwarded unprotected.
    #[error("the key is taken, and what holds it could not be read: {0}")]
    Taken(Box<StoreError>),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The memory store holds `memory_limit` bytes of records: no new keys until some expire.
    #[error("the memory store is full (memory_limit)")]
    Full,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreSetupError {
    #[error("cannot read the store password file {path}: {source}")]
    PasswordFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("invalid Redis configuration: {0}")]
    Redis(String),
    #[error("cannot read the store CA file {path}: {source}")]
    CaFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the store CA file {path} (store.tls_ca_file): {problem}")]
    CaInvalid {
        path: std::path::PathBuf,
        problem: String,
    },
    #[error(transparent)]
    KeyFile(#[from] KeyFileError),
    #[error("invalid PostgreSQL configuration: {0}")]
    Postgres(String),
    /// The PostgreSQL table is missing or of another shape (exit 1).
    #[error("{0}")]
    Schema(String),
}

impl StoreSetupError {
    /// A file was read and is wrong (a malformed key file, a CA file with
    /// no certificate): exit 2, not 1.
    pub fn is_configuration(&self) -> bool {
        match self {
            StoreSetupError::KeyFile(e) => e.is_configuration(),
            StoreSetupError::CaInvalid { .. } => true,
            _ => false,
        }
    }
}
