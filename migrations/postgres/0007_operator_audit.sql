-- tower-idempotency ledger v7, PostgreSQL: the operators' audit trail.
-- One row per verdict an operator recorded (the CLI, the admin router, or
-- `admin::Ledger::resolve`), written in the same transaction as the verdict:
-- a verdict never lands without its row, nor a row without its verdict.
-- actor / reason: who gave the verdict, and why (free text).
-- verdict: 'succeeded', 'failed' or 'rerun'; response_status: the answer's
--   status code (NULL for a rerun).
-- recorded_at: epoch milliseconds, database clock.
-- before_record: the ledger row as it was just before the verdict, a JSON
--   object (status, generation, parks, pending_step, recovery_point, ...).
-- No index on the ledger itself: one on the unsettled statuses would make
-- every completion a non-HOT update (see 0003).
CREATE TABLE IF NOT EXISTS tower_idempotency_audit (
    id              BIGSERIAL PRIMARY KEY,
    principal_id    TEXT   NOT NULL,
    operation       TEXT   NOT NULL,
    idem_key        TEXT   NOT NULL,
    actor           TEXT   NOT NULL,
    reason          TEXT   NOT NULL,
    verdict         TEXT   NOT NULL,
    response_status INTEGER,
    recorded_at     BIGINT NOT NULL,
    before_record   TEXT   NOT NULL
);
CREATE INDEX IF NOT EXISTS tower_idempotency_audit_scope
    ON tower_idempotency_audit (principal_id, operation, idem_key, id);
