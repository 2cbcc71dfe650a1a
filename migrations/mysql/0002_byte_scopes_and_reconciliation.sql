-- tower-idempotency ledger v2, MySQL/MariaDB.
-- Scope columns become VARBINARY: the _bin collations are PAD SPACE, so
-- 'alice' and 'alice ' were one scope. VARBINARY compares every byte.
-- Values are at most 255 bytes (longer ones are stored hashed).
ALTER TABLE idempotency_records
    MODIFY principal_id VARBINARY(255) NOT NULL,
    MODIFY operation    VARBINARY(255) NOT NULL,
    MODIFY idem_key     VARBINARY(255) NOT NULL;
-- The NEEDS_RECONCILIATION status (20 characters).
ALTER TABLE idempotency_records MODIFY status VARCHAR(32) CHARACTER SET ascii NOT NULL;
-- One statement, so it applies whole or not at all.
ALTER TABLE idempotency_records
    DROP CONSTRAINT idempotency_records_status,
    ADD CONSTRAINT idempotency_records_status
        CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED_FINAL', 'EXPIRED', 'NEEDS_RECONCILIATION'));
