-- tower-idempotency ledger v5, PostgreSQL: lease mode's fence names the claim.
-- claim_id: a random id drawn at each lease claim (NULL for rows claimed
--   before v5 and for the default mode). Every fenced write names it with the
--   generation, so a row deleted (or purged) and claimed again never matches a
--   fence taken on the earlier row, though both start at generation 1.
-- parks: how often the row was parked; completer passes back off by it.
-- pending_until: until when the pending step's call may still land (its
--   timeout); before that the row is neither listed as stranded nor open to
--   an operator's verdict.
-- A parked row is never leased NULL any more: its locked_until is when a
--   completer may retry its look-up (9223372036854775807: never).
ALTER TABLE idempotency_records
    ADD COLUMN claim_id TEXT,
    ADD COLUMN parks    INT NOT NULL DEFAULT 0,
    ADD COLUMN pending_until BIGINT;
UPDATE idempotency_records SET locked_until = 0
    WHERE status = 'NEEDS_RECONCILIATION' AND generation > 0 AND locked_until IS NULL;
