-- tower-idempotency ledger v5, MySQL/MariaDB: lease mode's fence names the
-- claim (see the PostgreSQL file for what each column means). DDL commits
-- on its own here: the UPDATE (which may be run again safely) comes first,
-- the ALTER (one statement, whole or not at all) last, and only where its
-- first column is missing, so a migration stopped before `migrate()`
-- recorded its version runs again.
UPDATE idempotency_records SET locked_until = 0
    WHERE status = 'NEEDS_RECONCILIATION' AND generation > 0 AND locked_until IS NULL;
SET @tower_idempotency_v5 = IF(
    (SELECT COUNT(*) FROM information_schema.columns c
     JOIN information_schema.tables t
       ON t.table_schema = c.table_schema AND t.table_name = c.table_name
     WHERE c.table_schema = DATABASE() AND c.table_name = 'idempotency_records'
       AND t.table_type = 'BASE TABLE' AND c.column_name = 'claim_id') = 0,
    'ALTER TABLE idempotency_records
        ADD COLUMN claim_id VARBINARY(64) NULL,
        ADD COLUMN parks    INT NOT NULL DEFAULT 0,
        ADD COLUMN pending_until BIGINT NULL',
    'DO 0');
PREPARE tower_idempotency_v5 FROM @tower_idempotency_v5;
EXECUTE tower_idempotency_v5;
DEALLOCATE PREPARE tower_idempotency_v5;
SET @tower_idempotency_v5 = NULL;
