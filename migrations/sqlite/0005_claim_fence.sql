-- tower-idempotency ledger v5, SQLite: lease mode's fence names the claim
-- (see the PostgreSQL file for what each column means).
ALTER TABLE idempotency_records ADD COLUMN claim_id TEXT;
ALTER TABLE idempotency_records ADD COLUMN parks INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN pending_until INTEGER;
UPDATE idempotency_records SET locked_until = 0
    WHERE status = 'NEEDS_RECONCILIATION' AND generation > 0 AND locked_until IS NULL;
