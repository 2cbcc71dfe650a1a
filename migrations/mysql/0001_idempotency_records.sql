-- tower-idempotency ledger, MySQL/MariaDB (InnoDB). Idempotent DDL: safe to run on every start.
-- Key columns use binary collations: keys are case-sensitive, as on the other stores.
-- Times are Unix epoch milliseconds, written by the application.
CREATE TABLE IF NOT EXISTS idempotency_records (
    principal_id        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    operation           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    idem_key            VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    request_fingerprint VARBINARY(64) NOT NULL,
    status              VARCHAR(16) CHARACTER SET ascii NOT NULL,
    response_status     INT NULL,
    response_headers    BLOB NULL,
    response_body       LONGBLOB NULL,
    resource_id         VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    created_at          BIGINT NOT NULL,
    expires_at          BIGINT NOT NULL,
    PRIMARY KEY (principal_id, operation, idem_key),
    -- The sweeper walks terminal rows, then tombstones, by expiry.
    KEY idempotency_records_sweep (status, expires_at),
    CONSTRAINT idempotency_records_status
        CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED_FINAL', 'EXPIRED'))
) ENGINE = InnoDB;
