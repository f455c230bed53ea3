//! The PostgreSQL client's errors as store errors, and which of them leave
//! a connection fit to go back to the pool.

use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::StoreError;

/// A client error as a store error: a connection that is gone, a server
/// shutting down, starting up or read-only (a standby: a failover in
/// progress) is `Unavailable`; a statement the server cancelled at its
/// `statement_timeout` a `Timeout`; anything else a `Backend` error.
pub(super) fn pg_error(e: tokio_postgres::Error, op_timeout: Duration) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::QUERY_CANCELED => StoreError::Timeout(op_timeout),
        Some(c) if UNAVAILABLE.contains(c) => StoreError::Unavailable(described(&e)),
        Some(_) => StoreError::Backend(described(&e)),
        None => StoreError::Unavailable(described(&e)),
    }
}

/// Does the connection stay in the pool after `e`? Only when the server
/// answered with an error of the statement: not when the connection broke,
/// nor when the server is read-only (a standby, or a fenced old primary: a
/// new connection finds the primary), shutting down or refusing.
pub(super) fn keeps_connection(e: &tokio_postgres::Error, client: &tokio_postgres::Client) -> bool {
    e.code().is_some_and(|c| !UNAVAILABLE.contains(c)) && !client.is_closed()
}

/// The server errors that say "not here, not now": the store is unavailable
/// (a failover in progress), and the connection is not used again.
const UNAVAILABLE: [SqlState; 9] = [
    SqlState::READ_ONLY_SQL_TRANSACTION,
    SqlState::ADMIN_SHUTDOWN,
    SqlState::CRASH_SHUTDOWN,
    SqlState::CANNOT_CONNECT_NOW,
    SqlState::CONNECTION_EXCEPTION,
    SqlState::CONNECTION_FAILURE,
    SqlState::CONNECTION_DOES_NOT_EXIST,
    SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
    SqlState::TOO_MANY_CONNECTIONS,
];

/// An error with its causes ("error performing TLS handshake: invalid peer
/// certificate: UnknownIssuer"): the client's own message alone hides them.
fn described(e: &tokio_postgres::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}
