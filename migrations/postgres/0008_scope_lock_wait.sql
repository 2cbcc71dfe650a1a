-- tower-idempotency ledger v8, PostgreSQL: the claim is prepared statements
-- on a transaction sqlx counts (see src/store/postgres.rs); the scope's
-- lock keys on 64 bits of the scope's SHA-256 (the two-key advisory lock,
-- both keys from the digest), and one finished row is written just before
-- the COMMIT. The v6 functions stay for instances of the previous release
-- during a rolling upgrade (both take the same lock only when their keys
-- meet, so do not mix releases on one route: drain it first).

-- Waits at most wait_ms for the scope's transaction advisory lock, for a
-- claim that found it held. The bound is set for the wait alone and the
-- caller's lock_timeout put back after it (a wait that runs out rolls its
-- setting back with the block), and a wait that runs out is a value, never
-- an error in the server log. Got: the lock is the calling transaction's,
-- and so is a transaction id (which tells the claim's next read that its
-- snapshot follows the lock).
CREATE OR REPLACE FUNCTION tower_idempotency_wait(k1 INTEGER, k2 INTEGER, wait_ms INTEGER)
RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved TEXT := current_setting('lock_timeout');
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait_ms || 'ms', true);
        PERFORM pg_advisory_xact_lock(k1, k2);
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    PERFORM set_config('lock_timeout', saved, true);
    PERFORM txid_current();
    RETURN true;
END $$;
