\set n random(1, 9000000000000000000)
\set s random(1, 64)
SELECT bench_claim_bool('user-42', 'POST /orders', 'k-' || :client_id || '-' || :n, '\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08', 86400000, 50) \; BEGIN \; SAVEPOINT tower_idempotency_claimed;
INSERT INTO orders (id, principal, body) VALUES (:client_id || '-' || :n, 'user-42', '{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}');
INSERT INTO order_items (order_id, line, sku, qty) VALUES (:client_id || '-' || :n, 1, 'sku-' || :s, 1);
UPDATE stock SET qty = qty - 1 WHERE sku = 'sku-' || :s;
RELEASE SAVEPOINT tower_idempotency_claimed \; SELECT tower_idempotency_finish('user-42', 'POST /orders', 'k-' || :client_id || '-' || :n, 'SUCCEEDED', 201, '\x0001000c636f6e74656e742d74797065', convert_to('{"orderId":"o-0f7a6c2e-1b2c-4d5e-8f90-123456789abc","status":"CREATED","amount":12000,"currency":"KRW"}', 'UTF8'), NULL), txid_current() \; COMMIT;
