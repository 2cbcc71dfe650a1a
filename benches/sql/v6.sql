-- Ledger v6 (built): the claim function (the scope's advisory lock, the
-- PROCESSING row inserted) and the recording function (the row updated),
-- each with the transaction's start or its COMMIT. Values as the layer sends
-- them (escape string literals).
\set n random(1, 9000000000000000000)
\set s random(1, 64)
SET TRANSACTION ISOLATION LEVEL READ COMMITTED \; SELECT * FROM tower_idempotency_claim(E'user-42', E'POST /orders', 'k-' || :client_id || '-' || :n, E'\\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'::bytea, 86400000, 50) \; BEGIN \; SAVEPOINT tower_idempotency_claimed;
INSERT INTO orders (id, principal, body) VALUES (:client_id || '-' || :n, 'user-42', '{"currency":"KRW","items":[{"sku":"A-10","qty":1}],"amount":12000}');
INSERT INTO order_items (order_id, line, sku, qty) VALUES (:client_id || '-' || :n, 1, 'sku-' || :s, 1);
UPDATE stock SET qty = qty - 1 WHERE sku = 'sku-' || :s;
RELEASE SAVEPOINT tower_idempotency_claimed \; SELECT tower_idempotency_finish(E'user-42', E'POST /orders', 'k-' || :client_id || '-' || :n, 'SUCCEEDED', 201, E'\\x0001000c636f6e74656e742d74797065'::bytea, E'\\x7b226f726465724964223a226f2d30663761366332652d316232632d346435652d386639302d313233343536373839616263222c22737461747573223a2243524541544544222c22616d6f756e74223a31323030302c2263757272656e6379223a224b5257227d'::bytea, NULL), txid_current() \; COMMIT;
