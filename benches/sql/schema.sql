-- The business tables of the bench's transaction (an order, its item, one of
-- 64 stock rows), and the functions of the one-write design (bench only).
-- The ledger is made by the crate's migrations.
DROP TABLE IF EXISTS order_items, orders, stock CASCADE;
CREATE TABLE orders (id text PRIMARY KEY, principal text NOT NULL, body jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE order_items (order_id text NOT NULL REFERENCES orders (id), line int NOT NULL, sku text NOT NULL, qty int NOT NULL, PRIMARY KEY (order_id, line));
CREATE TABLE stock (sku text PRIMARY KEY, qty bigint NOT NULL);
INSERT INTO stock SELECT 'sku-' || g, 1000000000 FROM generate_series(1, 64) g;
CREATE OR REPLACE FUNCTION bench_lock_read(p TEXT, o TEXT, k TEXT) RETURNS TEXT
LANGUAGE plpgsql AS $$
DECLARE s TEXT;
BEGIN
  PERFORM pg_advisory_xact_lock(1953064039, hashtext(p || E'\n' || o || E'\n' || k));
  SELECT status INTO s FROM idempotency_records
   WHERE principal_id = p AND operation = o AND idem_key = k;
  RETURN s;
END $$;
CREATE OR REPLACE FUNCTION bench_insert_final(p TEXT, o TEXT, k TEXT, fp BYTEA, st TEXT,
    code INT, hdr BYTEA, body BYTEA, rid TEXT, retention_ms BIGINT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE now_ms BIGINT := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
BEGIN
  INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint,
      status, response_status, response_headers, response_body, resource_id, created_at, expires_at)
  VALUES (p, o, k, fp, st, code, hdr, body, rid, now_ms, now_ms + retention_ms);
  RETURN now_ms + retention_ms;
END $$;
