-- tower-idempotency ledger v6, MySQL/MariaDB: the operators' audit trail
-- (see the PostgreSQL file, 0007, for what each column means). Scope
-- columns as in the ledger (VARBINARY: byte for byte).
CREATE TABLE IF NOT EXISTS tower_idempotency_audit (
    id              BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    principal_id    VARBINARY(255) NOT NULL,
    operation       VARBINARY(255) NOT NULL,
    idem_key        VARBINARY(255) NOT NULL,
    actor           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    reason          TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    verdict         VARCHAR(16) CHARACTER SET ascii NOT NULL,
    response_status INT NULL,
    recorded_at     BIGINT NOT NULL,
    before_record   LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    KEY tower_idempotency_audit_scope (principal_id, operation, idem_key, id)
) ENGINE = InnoDB;
