-- tower-idempotency ledger v2, SQLite: the NEEDS_RECONCILIATION status.
-- SQLite cannot alter a CHECK constraint, so the table is rebuilt.
-- TEXT with the default BINARY collation already compares byte for byte.
CREATE TABLE idempotency_records_v2 (
    principal_id        TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idem_key            TEXT    NOT NULL,
    request_fingerprint BLOB    NOT NULL,
    status              TEXT    NOT NULL
        CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED_FINAL', 'EXPIRED', 'NEEDS_RECONCILIATION')),
    response_status     INTEGER,
    response_headers    BLOB,
    response_body       BLOB,
    resource_id         TEXT,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (principal_id, operation, idem_key)
);
INSERT INTO idempotency_records_v2 SELECT * FROM idempotency_records;
DROP TABLE idempotency_records;
ALTER TABLE idempotency_records_v2 RENAME TO idempotency_records;
CREATE INDEX idempotency_records_sweep ON idempotency_records (status, expires_at);
