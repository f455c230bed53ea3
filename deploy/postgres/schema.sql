-- idemproxy's records in PostgreSQL ([store] backend = "postgres").
--
-- Create it with `idemproxy --init-store` (which runs this file with the
-- configured [store] table in place of idemproxy_records), or run it
-- yourself: psql -v ON_ERROR_STOP=1 -f deploy/postgres/schema.sql
-- The proxy never creates or alters the table when it starts: it checks the
-- columns below and refuses to start (exit 1) when they are missing or
-- different, or when the table is UNLOGGED (fix: ALTER TABLE ... SET LOGGED).
-- Running this file again changes nothing, but its ALTER TABLE takes a brief
-- ACCESS EXCLUSIVE lock (live requests wait); `--init-store` runs nothing
-- when the table is already there and right.
--
-- One row per idempotency key:
--   key         the store key, "<key_prefix>:<record id>" (a hash, never the client's key)
--   value       the encoded record: a reservation (processing) or a finished
--               answer, sealed when [store] encryption_key_file is set
--   token       the owner token of the request that reserved the key (bytes
--               3-18 of value): completions, renewals and releases compare it
--   finished    true once the answer is stored (a reservation is false)
--   expires_at  the end of the lease (processing) or of the ttl (finished),
--               on the database server's clock; a row past it is never
--               served, and is deleted in batches of 500 by the proxies
CREATE TABLE IF NOT EXISTS idemproxy_records (
    key        text        PRIMARY KEY,
    value      bytea       NOT NULL,
    token      bytea       NOT NULL,
    finished   boolean     NOT NULL,
    expires_at timestamptz NOT NULL
);

-- Records are stored uncompressed (most answers are small; sealed ones do
-- not compress): a reserve reads a large record's first 64 KiB and a replay
-- reads it in pieces of 256 KiB without decompressing the whole of it.
ALTER TABLE idemproxy_records ALTER COLUMN value SET STORAGE EXTERNAL;

-- The expiry sweep finds expired rows by this index.
CREATE INDEX IF NOT EXISTS idemproxy_records_expires_at ON idemproxy_records (expires_at);
