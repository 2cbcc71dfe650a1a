-- tower-idempotency ledger v3: a tombstone's expires_at is the time it may
-- be purged. Tombstones made before v3 did not record it, and their sweeper
-- may have kept them longer than the default 90 days: keep them 10 years
-- from their expiry (keeping a tombstone longer is safe; a key whose
-- tombstone is gone could run again). Purge them earlier by hand if your
-- tombstone retention is shorter.
UPDATE idempotency_records SET expires_at = expires_at + 315360000000 WHERE status = 'EXPIRED';
