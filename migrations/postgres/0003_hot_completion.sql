-- tower-idempotency ledger v3, PostgreSQL.
-- The completion (PROCESSING -> SUCCEEDED, response stored) updates no
-- indexed column any more, so it can be a heap-only (HOT) update: no index
-- entries are written for it. The sweeper finds work by expires_at alone:
-- a tombstone's expires_at now is the time it may be purged.
DROP INDEX IF EXISTS idempotency_records_sweep;
CREATE INDEX IF NOT EXISTS idempotency_records_expiry ON idempotency_records (expires_at);
-- Room on each page for the completed row version (HOT needs the same page).
ALTER TABLE idempotency_records SET (fillfactor = 80);
-- Tombstones made before v3 did not record their purge time, and their
-- sweeper may have kept them longer than the default 90 days: keep them
-- 10 years from their expiry (keeping a tombstone longer is safe; a key
-- whose tombstone is gone could run again). Purge them earlier by hand
-- if your tombstone retention is shorter.
UPDATE idempotency_records SET expires_at = expires_at + 315360000000 WHERE status = 'EXPIRED';
