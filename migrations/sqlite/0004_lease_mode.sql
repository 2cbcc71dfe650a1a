-- tower-idempotency ledger v4, SQLite: lease mode (see the PostgreSQL file
-- for what each column means).
ALTER TABLE idempotency_records ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN locked_until INTEGER;
ALTER TABLE idempotency_records ADD COLUMN recovery_point TEXT;
ALTER TABLE idempotency_records ADD COLUMN recovery_data BLOB;
ALTER TABLE idempotency_records ADD COLUMN pending_step TEXT;
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (locked_until);
