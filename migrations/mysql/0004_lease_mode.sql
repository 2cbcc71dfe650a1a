-- tower-idempotency ledger v4, MySQL/MariaDB: lease mode (see the PostgreSQL
-- file for what each column means). One statement, so it applies whole or
-- not at all. DDL commits on its own here, before `migrate()` records the
-- version: the statement runs only where its first column is missing, so a
-- migration stopped in between runs again.
SET @tower_idempotency_v4 = IF(
    (SELECT COUNT(*) FROM information_schema.columns c
     JOIN information_schema.tables t
       ON t.table_schema = c.table_schema AND t.table_name = c.table_name
     WHERE c.table_schema = DATABASE() AND c.table_name = 'idempotency_records'
       AND t.table_type = 'BASE TABLE' AND c.column_name = 'generation') = 0,
    'ALTER TABLE idempotency_records
        ADD COLUMN generation     BIGINT NOT NULL DEFAULT 0,
        ADD COLUMN locked_until   BIGINT NULL,
        ADD COLUMN recovery_point VARBINARY(255) NULL,
        ADD COLUMN recovery_data  LONGBLOB NULL,
        ADD COLUMN pending_step   VARBINARY(255) NULL,
        ADD INDEX idempotency_records_lease (locked_until)',
    'DO 0');
PREPARE tower_idempotency_v4 FROM @tower_idempotency_v4;
EXECUTE tower_idempotency_v4;
DEALLOCATE PREPARE tower_idempotency_v4;
SET @tower_idempotency_v4 = NULL;
