//! The documented size of a ledger row, measured: PostgreSQL table plus
//! indexes, for realistic rows (UUID key, 300-byte JSON answer).

use tower_idempotency::testkit::ConformanceDb;

#[tokio::test]
async fn bytes_per_ledger_row_on_postgres() {
    let (pool, _cleanup) = <sqlx::Postgres as ConformanceDb>::fresh().await;
    let rows: i64 = 20_000;
    let body = format!(
        r#"{{"orderId":"o-5d23b4ca48fed6a5","principal":"user-4242","currency":"KRW","items":[{{"sku":"A-10","qty":2}}],"amount":12000,"memo":"{}","createdAt":1795963187878}}"#,
        "m".repeat(150)
    );
    assert!((290..=310).contains(&body.len()), "{}", body.len());
    sqlx::query(
        "INSERT INTO idempotency_records SELECT 'user-' || (g % 1000), 'create-order', \
         md5(g::text)::uuid::text, sha256(g::text::bytea), 'SUCCEEDED', 201, \
         convert_to('content-type:application/json' || chr(10) || 'location:/orders/o-5d23b4ca48fed6a5' || chr(10), 'UTF8'), \
         convert_to($2, 'UTF8'), 'o-5d23b4ca48fed6a5', 1795963187878, 1796049587878 \
         FROM generate_series(1, $1) AS g",
    )
    .bind(rows)
    .bind(&body)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    let (table, total): (i64, i64) = sqlx::query_as(
        "SELECT pg_table_size('idempotency_records'), pg_total_relation_size('idempotency_records')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let per_row = total / rows;
    println!(
        "ledger row on PostgreSQL: {} bytes heap, {} bytes with indexes ({} rows, {}-byte answers)",
        table / rows,
        per_row,
        rows,
        body.len()
    );
    // The README states about 720 bytes per row for this shape; a layout
    // change that doubles it should be noticed.
    assert!((400..=900).contains(&per_row), "{per_row} bytes per row");

    // The same rows as tombstones (answers dropped), after the table is rewritten.
    let sweeper = tower_idempotency::Sweeper::new(pool.clone())
        .with_batch_size(5000)
        .with_tombstone_retention(std::time::Duration::from_secs(1 << 40));
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(10 * 24 * 3600);
    let report = sweeper.sweep_at(later).await.unwrap();
    assert_eq!(report.expired, rows as u64);
    sqlx::raw_sql("VACUUM FULL idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    let total: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('idempotency_records')")
        .fetch_one(&pool)
        .await
        .unwrap();
    let per_tombstone = total / rows;
    println!("tombstone on PostgreSQL: {per_tombstone} bytes with indexes");
    assert!(
        per_tombstone < per_row / 2,
        "{per_tombstone} bytes per tombstone"
    );
}

/// Ledger v8 (issue 25): a first execution writes one ledger tuple, the
/// finished row inserted just before the `COMMIT`; nothing is updated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_execution_writes_one_ledger_tuple_on_postgres() {
    use tower_idempotency::testkit::{Harness, order, send};
    let h = Harness::<sqlx::Postgres>::new().await;
    let app = h.app();
    let before = ledger_stats(&h.pool, |_| true).await;
    for i in 0..200 {
        let key = format!("one-{i}");
        let a = send(&app, order(Some("user-42"), Some(&key), r#"{"amount":1}"#)).await;
        assert_eq!(a.status, http::StatusCode::CREATED);
    }
    let after = ledger_stats(&h.pool, |s| s.0 >= before.0 + 200).await;
    let (inserts, updates) = (after.0 - before.0, after.1 - before.1);
    println!("ledger writes for 200 first executions: {inserts} inserts, {updates} updates");
    assert_eq!(inserts, 200, "one row per first execution");
    assert_eq!(updates, 0, "nothing updated");
}

/// The ledger's `(inserts, updates, HOT updates)` once `done` holds of
/// them: the pooled backends report their counts within seconds.
async fn ledger_stats(
    pool: &sqlx::PgPool,
    done: impl Fn((i64, i64, i64)) -> bool,
) -> (i64, i64, i64) {
    let mut seen = (0, 0, 0);
    for _ in 0..200 {
        seen = sqlx::query_as(
            "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
             WHERE relname = 'idempotency_records'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if done(seen) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    seen
}
