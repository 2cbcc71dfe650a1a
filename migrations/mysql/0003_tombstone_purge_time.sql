-- tower-idempotency ledger v3: a tombstone's expires_at is the time it may
-- be purged. Tombstones made before v3 keep the default 90 days from their
-- expiry.
UPDATE idempotency_records SET expires_at = expires_at + 7776000000 WHERE status = 'EXPIRED';
