-- tower-idempotency ledger v6, PostgreSQL: the default mode's claim and
-- recording as server-side functions.
-- A plpgsql function plans its statements once per session and keeps the
-- plans, where a literal statement is parsed and planned on every request;
-- and it can tell a lost claim as a value, so an ordinary retry raises no
-- error on the server (the claim before v6 divided by zero to tell it).
-- Both work through PgBouncer in transaction pooling mode (no prepared
-- statement crosses a transaction) and are called from one simple query
-- with the transaction's start or its COMMIT, so no round trip is added.

-- Claims a scope for the calling transaction.
-- Every claim first takes a transaction advisory lock on the scope (class
-- 1953064039, "tide", and the scope's hash: scopes whose hashes meet only
-- wait on each other), so claims of one scope run one at a time. A claim
-- that finds the lock held first reads the scope's row: a committed row
-- answers at once (retries of a finished key never queue on the lock).
-- Otherwise it waits for the lock at most wait_ms, in a block that catches
-- the timeout: a duplicate that waits raises no error, and nothing of it
-- reaches the server log. Then it inserts the PROCESSING row: the primary
-- key decides who owns the scope, and a row that holds it (committed while
-- this claim waited) is read back. The row is written at the claim, not
-- only with the COMMIT, so that whatever commits while the scope is held
-- (a handler that ends the transaction itself, say with a nested begin()
-- and commit() on its connection) commits the PROCESSING row too, and a
-- duplicate then meets it instead of running again.
-- claimed is
--   true:  the scope is this transaction's;
--   false: a committed row holds the scope; the other columns are that row,
--          all NULL when it was deleted meanwhile;
--   NULL:  another transaction's claim was still running after wait_ms.
-- The insert's own wait on a row of a writer that took no advisory lock is
-- bounded by wait_ms too, and fails with lock_not_available (at REPEATABLE
-- READ or SERIALIZABLE, a winner that committed after this transaction's
-- snapshot is a serialization failure there). Each bound is set for its
-- wait alone and the caller's lock_timeout put back after it (a wait that
-- fails rolls its setting back with it).
CREATE OR REPLACE FUNCTION tower_idempotency_claim(
    p_principal TEXT, p_operation TEXT, p_key TEXT, p_fingerprint BYTEA,
    p_retention_ms BIGINT, p_wait_ms INTEGER,
    OUT claimed BOOLEAN, OUT status TEXT, OUT request_fingerprint BYTEA,
    OUT response_status INTEGER, OUT response_headers BYTEA, OUT response_body BYTEA,
    OUT resource_id TEXT, OUT expires_at BIGINT, OUT past_expiry BIGINT,
    OUT generation BIGINT, OUT live BIGINT, OUT recovery_point TEXT,
    OUT recovery_data BYTEA, OUT pending_step TEXT, OUT claim_id TEXT, OUT parks BIGINT)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    now_ms BIGINT;
    scope_hash INTEGER := hashtext(p_principal || E'\n' || p_operation || E'\n' || p_key);
    saved TEXT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1953064039, scope_hash) THEN
        SELECT true INTO claimed FROM idempotency_records r
            WHERE r.principal_id = p_principal COLLATE "default"
              AND r.operation = p_operation COLLATE "default"
              AND r.idem_key = p_key COLLATE "default";
        IF NOT FOUND THEN
            saved := current_setting('lock_timeout');
            BEGIN
                PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
                PERFORM pg_advisory_xact_lock(1953064039, scope_hash);
            EXCEPTION WHEN lock_not_available THEN
                claimed := NULL;
                RETURN;
            END;
            PERFORM set_config('lock_timeout', saved, true);
        END IF;
    END IF;
    claimed := NULL;
    now_ms := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
    saved := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    INSERT INTO idempotency_records AS r
        (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at)
    VALUES (p_principal, p_operation, p_key, p_fingerprint, 'PROCESSING', now_ms,
            now_ms + p_retention_ms)
    ON CONFLICT (principal_id, operation, idem_key) DO NOTHING;
    claimed := FOUND;
    PERFORM set_config('lock_timeout', saved, true);
    IF claimed THEN
        RETURN;
    END IF;
    now_ms := (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT;
    SELECT r.status, r.request_fingerprint, r.response_status, r.response_headers,
        r.response_body, r.resource_id, r.expires_at,
        CASE WHEN r.expires_at <= now_ms THEN 1 ELSE 0 END, r.generation,
        CASE WHEN r.locked_until > now_ms THEN 1 ELSE 0 END,
        r.recovery_point, r.recovery_data, r.pending_step, r.claim_id, r.parks
        INTO status, request_fingerprint, response_status, response_headers,
        response_body, resource_id, expires_at, past_expiry, generation, live,
        recovery_point, recovery_data, pending_step, claim_id, parks
        FROM idempotency_records r
        WHERE r.principal_id = p_principal COLLATE "default"
          AND r.operation = p_operation COLLATE "default" AND r.idem_key = p_key COLLATE "default";
END $$;

-- Records the answer on the calling transaction's PROCESSING row and
-- returns the row's expiry. A row that is gone (a handler deleted it) is an
-- error, so the COMMIT that follows in the same query never runs without
-- the ledger row.
CREATE OR REPLACE FUNCTION tower_idempotency_finish(
    p_principal TEXT, p_operation TEXT, p_key TEXT, p_status TEXT,
    p_response_status INTEGER, p_response_headers BYTEA, p_response_body BYTEA,
    p_resource_id TEXT)
RETURNS BIGINT
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    expiry BIGINT;
BEGIN
    UPDATE idempotency_records
        SET status = p_status, response_status = p_response_status,
            response_headers = p_response_headers, response_body = p_response_body,
            resource_id = p_resource_id
        WHERE principal_id = p_principal COLLATE "default" AND operation = p_operation COLLATE "default"
          AND idem_key = p_key COLLATE "default" AND status = 'PROCESSING'
        RETURNING expires_at INTO expiry;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency ledger row is gone';
    END IF;
    RETURN expiry;
END $$;

-- Default-mode rows never have a lease: the lease index holds leased rows
-- only, so a default-mode insert writes one index entry fewer.
DROP INDEX IF EXISTS idempotency_records_lease;
CREATE INDEX idempotency_records_lease ON idempotency_records (locked_until)
    WHERE locked_until IS NOT NULL;
