-- Ledger v8 on MySQL/MariaDB, migration 8: the ledger table takes a name of
-- the crate's own, `tower_idempotency_records`, and every ledger statement
-- of the layer names it directly. A TEMPORARY table named
-- `idempotency_records` (a handler's, left on a pooled connection) shadows
-- a table of that name on its connection, qualified or not; migration 7
-- kept the ledger out of its reach through a view, which the server expands
-- for every statement that names it (about 20 µs of `mariadbd` each, about
-- 100 µs per first execution: docs/performance.md). A temporary table named
-- `tower_idempotency_records` would still shadow the ledger, as one named
-- `tower_idempotency_ledger` shadowed the view: the name is the crate's.
--
-- `idempotency_records` stays, as a view of the table, for every reader and
-- writer outside the layer (operators' queries, older releases' tools);
-- `tower_idempotency_ledger` stays, on the table itself, for a release
-- before this one still running during a rolling upgrade. Both are MERGE
-- (each statement runs on the table: its unique key and its locks) and
-- INVOKER (the caller's privileges on the table). `RENAME TABLE` waits for
-- the transactions that use the ledger (`migrate()` bounds the wait) and
-- is atomic; until the next statement replaces the view, a release before
-- this one gets "view references invalid table" (a retryable 503) for a
-- moment. Privileges granted on the table itself stay with the old name
-- (docs/upgrading.md). A later migration that changes
-- the table's columns recreates both views (`SELECT *` is expanded when a
-- view is created).
--
-- MySQL's DDL commits statement by statement, so the migration can stop
-- halfway (a lost connection, a refused `CREATE VIEW`) and is run again by
-- the next `migrate()`: the rename happens only while
-- `idempotency_records` is still the table, and the views are replaced.
SET @tower_idempotency_rename = IF(
    (SELECT COUNT(*) FROM information_schema.tables
     WHERE table_schema = DATABASE() AND table_name = 'idempotency_records'
       AND table_type = 'BASE TABLE') = 1,
    'RENAME TABLE idempotency_records TO tower_idempotency_records',
    'DO 0');
PREPARE tower_idempotency_rename FROM @tower_idempotency_rename;
EXECUTE tower_idempotency_rename;
DEALLOCATE PREPARE tower_idempotency_rename;
SET @tower_idempotency_rename = NULL;
CREATE OR REPLACE ALGORITHM = MERGE SQL SECURITY INVOKER VIEW idempotency_records AS
SELECT * FROM tower_idempotency_records;
CREATE OR REPLACE ALGORITHM = MERGE SQL SECURITY INVOKER VIEW tower_idempotency_ledger AS
SELECT * FROM tower_idempotency_records;
