-- tower-idempotency ledger v6, SQLite: the operators' audit trail (see the
-- PostgreSQL file, 0007, for what each column means).
CREATE TABLE IF NOT EXISTS tower_idempotency_audit (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    principal_id    TEXT    NOT NULL,
    operation       TEXT    NOT NULL,
    idem_key        TEXT    NOT NULL,
    actor           TEXT    NOT NULL,
    reason          TEXT    NOT NULL,
    verdict         TEXT    NOT NULL,
    response_status INTEGER,
    recorded_at     INTEGER NOT NULL,
    before_record   TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS tower_idempotency_audit_scope
    ON tower_idempotency_audit (principal_id, operation, idem_key, id);
