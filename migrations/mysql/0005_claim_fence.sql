-- tower-idempotency ledger v5, MySQL/MariaDB: lease mode's fence names the
-- claim (see the PostgreSQL file for what each column means).
ALTER TABLE idempotency_records
    ADD COLUMN claim_id VARBINARY(64) NULL,
    ADD COLUMN parks    INT NOT NULL DEFAULT 0;
UPDATE idempotency_records SET locked_until = 0
    WHERE status = 'NEEDS_RECONCILIATION' AND generation > 0 AND locked_until IS NULL;
