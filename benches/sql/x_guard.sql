\set n random(1, 9000000000000000000)
\set s random(1, 64)
BEGIN;
INSERT INTO orders (id, principal, body) VALUES (:client_id || '-' || :n, 'user-42', '{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}');
INSERT INTO order_items (order_id, line, sku, qty) VALUES (:client_id || '-' || :n, 1, 'sku-' || :s, 1);
UPDATE stock SET qty = qty - 1 WHERE sku = 'sku-' || :s;
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, response_status, response_headers, response_body, resource_id, created_at, expires_at) SELECT 'user-42', 'POST /orders', 'k-' || :client_id || '-' || :n, '\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'::bytea, 'SUCCEEDED', 201, '\x0001000c636f6e74656e742d74797065'::bytea, '\x7b226f72646572'::bytea, NULL, (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT, (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT + 86400000 WHERE txid_current_if_assigned() IS NOT NULL AND (SELECT set_config('lock_timeout', '5000ms', true)) IS NOT NULL ON CONFLICT (principal_id, operation, idem_key) DO NOTHING RETURNING expires_at, txid_current();
COMMIT;
