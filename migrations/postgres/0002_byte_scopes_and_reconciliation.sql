-- tower-idempotency ledger v2, PostgreSQL: the NEEDS_RECONCILIATION status
-- (a key whose outcome is unknown until an operator resolves it).
-- TEXT already compares byte for byte under deterministic collations.
ALTER TABLE idempotency_records DROP CONSTRAINT IF EXISTS idempotency_records_status_check;
ALTER TABLE idempotency_records DROP CONSTRAINT IF EXISTS idempotency_records_status;
ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_status
    CHECK (status IN ('PROCESSING', 'SUCCEEDED', 'FAILED_FINAL', 'EXPIRED', 'NEEDS_RECONCILIATION'));
