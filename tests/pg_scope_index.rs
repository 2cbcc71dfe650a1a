//! PostgreSQL finds a scope's ledger row through the ledger's unique index,
//! whatever the layer's mode: the claim's read, the fetch of a replay and
//! the row written at commit compare the scope columns with values decoded
//! by the statement (`convert_from($n, 'UTF8')`), whose result takes the
//! collation of its `name` argument (`C`); compared as such with the
//! columns (the database's default collation), the index cannot serve the
//! comparison and every lookup reads the whole ledger. Judged by the
//! server's own count of sequential scans on the ledger, not by a clock.

use sqlx::postgres::{PgConnectOptions, PgPool};
use tower_idempotency::testkit::{Harness, order, send};

/// `seq_scan` of the ledger once the counters are still (a backend reports
/// its counts when it ends, shortly after its pool is closed).
async fn ledger_seq_scans(opts: &PgConnectOptions) -> i64 {
    let admin = PgPool::connect_with(opts.clone()).await.unwrap();
    let read = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'idempotency_records'",
        )
        .fetch_one(&admin)
        .await
        .unwrap()
    };
    let mut last = read().await;
    for _ in 0..50 {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        sqlx::raw_sql("SELECT pg_stat_clear_snapshot()")
            .execute(&admin)
            .await
            .unwrap();
        let now = read().await;
        if now == last {
            break;
        }
        last = now;
    }
    admin.close().await;
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_lookups_use_the_ledger_index() {
    let h = Harness::<sqlx::Postgres>::new().await;
    // A ledger the size of a day's traffic, analyzed: reading it whole is
    // never the planner's cheapest way to one scope.
    sqlx::raw_sql(
        "INSERT INTO idempotency_records (principal_id, operation, idem_key, \
         request_fingerprint, status, response_status, created_at, expires_at) \
         SELECT 'bulk', 'POST /orders', 'k-' || i, '\\x00'::bytea, 'SUCCEEDED', 201, 0, \
         9000000000000 FROM generate_series(1, 20000) i; ANALYZE idempotency_records",
    )
    .execute(h.plain())
    .await
    .unwrap();
    let opts = (*h.pool.connect_options()).clone();
    h.pool.close().await;
    let before = ledger_seq_scans(&opts).await;
    let h = h.with_pool(PgPool::connect_with(opts.clone()).await.unwrap());
    let body = r#"{"amount":1,"items":[]}"#;
    let claim_first = h.app();
    let at_commit = h.app_with(h.layer().with_claim_at_commit());
    for (app, key) in [(&claim_first, "first"), (&at_commit, "at-commit")] {
        for _ in 0..6 {
            let a = send(app, order(Some("user-42"), Some(key), body)).await;
            assert_eq!(a.status, http::StatusCode::CREATED, "{a:?}");
        }
    }
    assert_eq!(h.orders().await, 2);
    h.pool.close().await;
    let after = ledger_seq_scans(&opts).await;
    assert_eq!(
        after - before,
        0,
        "sequential scans of the ledger for 12 requests (claims, replays, rows written at commit)"
    );
}
