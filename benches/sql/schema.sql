-- The business tables of the bench's transaction (an order, its item, one of
-- 64 stock rows), and the bench-only functions of the one-write design.
DROP TABLE IF EXISTS order_items, orders, stock CASCADE;
CREATE TABLE orders (id text PRIMARY KEY, principal text NOT NULL, body jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE order_items (order_id text NOT NULL REFERENCES orders (id), line int NOT NULL, sku text NOT NULL, qty int NOT NULL, PRIMARY KEY (order_id, line));
CREATE TABLE stock (sku text PRIMARY KEY, qty bigint NOT NULL);
INSERT INTO stock SELECT 'sku-' || g, 1000000000 FROM generate_series(1, 64) g;
-- One write per first execution: a transaction-scoped advisory lock on the
-- scope, a read, and the finished row inserted with the COMMIT.
CREATE OR REPLACE FUNCTION bench_lock_read(p text, o text, k text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE s text;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtextextended(p || ' ' || o || ' ' || k, 0));
  SELECT status INTO s FROM idempotency_records WHERE principal_id = p AND operation = o AND idem_key = k;
  RETURN s;
END $$;
CREATE OR REPLACE FUNCTION bench_insert_final(p text, o text, k text, fp bytea, st int, hdr bytea, body bytea, rid text, retention_ms bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE now_ms bigint := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
BEGIN
  INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, response_status, response_headers, response_body, resource_id, created_at, expires_at)
  VALUES (p, o, k, fp, 'SUCCEEDED', st, hdr, body, rid, now_ms, now_ms + retention_ms);
  RETURN now_ms + retention_ms;
END $$;
-- Variants for measuring where v6's time goes (bench only).
CREATE OR REPLACE FUNCTION bench_claim_bool(p_principal TEXT, p_operation TEXT, p_key TEXT, p_fingerprint BYTEA, p_retention_ms BIGINT, p_wait_ms INTEGER) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE now_ms BIGINT := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
BEGIN
    INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at)
    VALUES (p_principal, p_operation, p_key, p_fingerprint, 'PROCESSING', now_ms, now_ms + p_retention_ms)
    ON CONFLICT (principal_id, operation, idem_key) DO NOTHING;
    RETURN FOUND;
END $$;
CREATE OR REPLACE FUNCTION bench_claim_bool_set(p_principal TEXT, p_operation TEXT, p_key TEXT, p_fingerprint BYTEA, p_retention_ms BIGINT, p_wait_ms INTEGER) RETURNS boolean
LANGUAGE plpgsql SET lock_timeout = 0 AS $$
DECLARE now_ms BIGINT := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at)
    VALUES (p_principal, p_operation, p_key, p_fingerprint, 'PROCESSING', now_ms, now_ms + p_retention_ms)
    ON CONFLICT (principal_id, operation, idem_key) DO NOTHING;
    RETURN FOUND;
END $$;
CREATE OR REPLACE FUNCTION bench_claim_bool_manual(p_principal TEXT, p_operation TEXT, p_key TEXT, p_fingerprint BYTEA, p_retention_ms BIGINT, p_wait_ms INTEGER) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE now_ms BIGINT := (EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000)::BIGINT;
  saved TEXT := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    INSERT INTO idempotency_records (principal_id, operation, idem_key, request_fingerprint, status, created_at, expires_at)
    VALUES (p_principal, p_operation, p_key, p_fingerprint, 'PROCESSING', now_ms, now_ms + p_retention_ms)
    ON CONFLICT (principal_id, operation, idem_key) DO NOTHING;
    PERFORM set_config('lock_timeout', saved, true);
    RETURN FOUND;
END $$;
