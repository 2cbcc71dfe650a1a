-- Ledger v8 on MySQL/MariaDB, migration 7: every ledger statement of the
-- layer names this view instead of the table. A TEMPORARY table named
-- `idempotency_records` (a handler's, left on a pooled connection) shadows
-- the table on that connection, qualified or not; it never replaces a
-- view's table. MERGE: each statement runs on the table itself (inserts,
-- updates and deletes through the view, with the table's unique key and
-- locks). INVOKER: the view asks for the caller's privileges on the table,
-- never a definer's. A later migration that changes the table's columns
-- recreates the view (`SELECT *` is expanded when the view is created).
CREATE OR REPLACE ALGORITHM = MERGE SQL SECURITY INVOKER VIEW tower_idempotency_ledger AS
SELECT * FROM idempotency_records;
