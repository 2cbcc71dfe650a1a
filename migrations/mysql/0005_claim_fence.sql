-- tower-idempotency ledger v5, MySQL/MariaDB: lease mode's fence names the
-- claim (see the PostgreSQL file for what each column means). DDL commits
-- on its own here: the UPDATE (which may be run again safely) comes first,
-- the ALTER (one statement, whole or not at all) last.
UPDATE idempotency_records SET locked_until = 0
    WHERE status = 'NEEDS_RECONCILIATION' AND generation > 0 AND locked_until IS NULL;
ALTER TABLE idempotency_records
    ADD COLUMN claim_id VARBINARY(64) NULL,
    ADD COLUMN parks    INT NOT NULL DEFAULT 0,
    ADD COLUMN pending_until BIGINT NULL;
