-- tower-idempotency ledger v4, PostgreSQL: lease mode.
-- generation: 0 for a row of the default (one transaction) mode; a lease
--   row starts at 1 and each takeover adds 1 (the fencing token).
-- locked_until: end of the lease, epoch milliseconds (database clock);
--   NULL once the row is no longer leased (done, parked, or default mode).
-- recovery_point / recovery_data: the last committed phase and a JSON object
--   of what each phase and step saved.
-- pending_step: an external step that may have run and whose outcome is not
--   recorded yet.
ALTER TABLE idempotency_records
    ADD COLUMN generation     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN locked_until   BIGINT,
    ADD COLUMN recovery_point TEXT,
    ADD COLUMN recovery_data  BYTEA,
    ADD COLUMN pending_step   TEXT;
-- The completer finds lapsed leases by locked_until. A default-mode row never
-- sets it, so its completion stays a heap-only update.
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (locked_until);
