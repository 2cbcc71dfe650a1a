-- The million-row ledger the README's timings were measured on (PostgreSQL).
-- On an empty database: `tower-idempotency migrate`, then
--   psql -v ON_ERROR_STOP=1 -f docs/ledger-1m.sql "$DATABASE_URL"
\set now '(EXTRACT(EPOCH FROM now()) * 1000)::BIGINT'
-- 880 000 settled default-mode answers over the last day.
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, response_status, response_headers, response_body, created_at, expires_at)
SELECT 'user-' || (g % 5000), CASE WHEN g % 3 = 0 THEN 'POST /payments' ELSE 'POST /orders' END, 'k-' || g, '\x00', 'SUCCEEDED', 201, convert_to(E'content-type:application/json\n', 'UTF8'), convert_to('{"orderId":"o-' || g || '"}', 'UTF8'), :now - (g % 86400000), :now - (g % 86400000) + 86400000
FROM generate_series(1, 880000) g;
-- 19 930 final failures.
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, response_status, response_body, created_at, expires_at)
SELECT 'user-' || (g % 5000), 'POST /payments', 'f-' || g, '\x00', 'FAILED_FINAL', 402, convert_to('{"type":"card-declined"}', 'UTF8'), :now - (g * 4000), :now - (g * 4000) + 86400000
FROM generate_series(1, 19930) g;
-- 100 000 tombstones.
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at)
SELECT 'user-' || (g % 5000), 'POST /orders', 't-' || g, '\x00', 'EXPIRED', :now - 172800000 - g, :now + 7776000000
FROM generate_series(1, 100000) g;
-- 50 parked lease-mode payments (pending step `charge`).
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at, generation, locked_until, recovery_point, recovery_data, pending_step, claim_id, parks)
SELECT 'user-' || g, 'POST /payments', 'parked-' || g, '\x00', 'NEEDS_RECONCILIATION', :now - g * 60000, :now - g * 60000 + 86400000, 2, 9223372036854775807, 'created', convert_to('{}', 'UTF8'), 'charge', md5(g::text), 1
FROM generate_series(1, 50) g;
-- 20 leases that lapsed a minute ago with the step pending.
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at, generation, locked_until, recovery_point, recovery_data, pending_step, claim_id, parks)
SELECT 'user-' || g, 'POST /payments', 'lapsed-' || g, '\x00', 'PROCESSING', :now - g * 30000, :now - g * 30000 + 86400000, 1, :now - 60000, 'created', convert_to('{}', 'UTF8'), 'charge', md5('l' || g::text), 0
FROM generate_series(1, 20) g;
VACUUM ANALYZE idempotency_records;
-- For the `sweep` with work to do: 10 000 answers past retention.
-- UPDATE idempotency_records SET expires_at = 1000
--     WHERE status = 'SUCCEEDED' AND idem_key IN (SELECT 'k-' || g FROM generate_series(1, 10000) g);
