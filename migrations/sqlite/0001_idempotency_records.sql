-- tower-idempotency ledger, SQLite. Idempotent DDL: safe to run on every start.
-- Times are Unix epoch milliseconds, written by the application.
CREATE TABLE IF NOT EXISTS idempotency_records (
    principal_id        TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idem_key            TEXT    NOT NULL,
    request_fingerprint BLOB    NOT NULL,
    status              TEXT    NOT NULL
        CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED_FINAL', 'EXPIRED')),
    response_status     INTEGER,
    response_headers    BLOB,
    response_body       BLOB,
    resource_id         TEXT,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (principal_id, operation, idem_key)
);
-- The sweeper walks terminal rows, then tombstones, by expiry: (status, expires_at)
-- serves both range scans without wading through the other kind.
CREATE INDEX IF NOT EXISTS idempotency_records_sweep ON idempotency_records (status, expires_at);
