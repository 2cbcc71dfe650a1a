-- tower-idempotency ledger v4, MySQL/MariaDB: lease mode (see the PostgreSQL
-- file for what each column means). One statement, so it applies whole or
-- not at all.
ALTER TABLE idempotency_records
    ADD COLUMN generation     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN locked_until   BIGINT NULL,
    ADD COLUMN recovery_point VARBINARY(255) NULL,
    ADD COLUMN recovery_data  LONGBLOB NULL,
    ADD COLUMN pending_step   VARBINARY(255) NULL,
    ADD INDEX idempotency_records_lease (locked_until);
