-- The business tables of the bench's transaction (an order, its item, one of
-- 64 stock rows). The ledger is made by the crate's migrations.
DROP TABLE IF EXISTS order_items, orders, stock CASCADE;
CREATE TABLE orders (id text PRIMARY KEY, principal text NOT NULL, body jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE order_items (order_id text NOT NULL REFERENCES orders (id), line int NOT NULL, sku text NOT NULL, qty int NOT NULL, PRIMARY KEY (order_id, line));
CREATE TABLE stock (sku text PRIMARY KEY, qty bigint NOT NULL);
INSERT INTO stock SELECT 'sku-' || g, 1000000000 FROM generate_series(1, 64) g;
