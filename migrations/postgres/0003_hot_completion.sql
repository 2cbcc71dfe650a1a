-- tower-idempotency ledger v3, PostgreSQL.
-- The completion (PROCESSING -> SUCCEEDED, response stored) updates no
-- indexed column any more, so it can be a heap-only (HOT) update: no index
-- entries are written for it. The sweeper finds work by expires_at alone:
-- a tombstone's expires_at now is the time it may be purged.
DROP INDEX IF EXISTS idempotency_records_sweep;
CREATE INDEX IF NOT EXISTS idempotency_records_expiry ON idempotency_records (expires_at);
-- Room on each page for the completed row version (HOT needs the same page).
ALTER TABLE idempotency_records SET (fillfactor = 80);
-- Tombstones made before v3 keep the default 90 days from their expiry.
UPDATE idempotency_records SET expires_at = expires_at + 7776000000 WHERE status = 'EXPIRED';
