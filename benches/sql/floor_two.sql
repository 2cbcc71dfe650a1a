-- The floor with bound parameters for a claim-first design (pgbench -M
-- prepared): the bare transaction plus two ledger statements, each in a round
-- trip of its own, as sqlx sends them: the claim before the handler (an
-- `INSERT ... PROCESSING ... ON CONFLICT DO NOTHING RETURNING`, which holds the
-- scope and says whether a row was there) and the answer after it (an
-- `UPDATE`). No lock, no wait bound, no savepoint: what any claim-first design
-- costs at least, since a transaction sqlx counts begins with a statement whose
-- results sqlx discards and sqlx never pipelines a bound statement with the
-- COMMIT.
\set n random(1, 9000000000000000000)
\set s random(1, 64)
BEGIN;
INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at) VALUES ('user-42', 'POST /orders', 'k-' || :client_id || '-' || :n, '\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'::bytea, 'PROCESSING', (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT, (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT + 86400000) ON CONFLICT DO NOTHING RETURNING expires_at;
INSERT INTO orders (id, principal, body) VALUES (:client_id || '-' || :n, 'user-42', '{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}');
INSERT INTO order_items (order_id, line, sku, qty) VALUES (:client_id || '-' || :n, 1, 'sku-' || :s, 1);
UPDATE stock SET qty = qty - 1 WHERE sku = 'sku-' || :s;
UPDATE idempotency_records SET status = 'SUCCEEDED', response_status = 201, response_headers = '\x0001000c636f6e74656e742d74797065'::bytea, response_body = '\x7b226f726465724964223a226f2d30663761366332652d316232632d346435652d386639302d313233343536373839616263222c22737461747573223a2243524541544544222c22616d6f756e74223a31323030302c2263757272656e6379223a224b5257227d'::bytea WHERE principal_id = 'user-42' AND operation = 'POST /orders' AND idem_key = 'k-' || :client_id || '-' || :n;
COMMIT;
