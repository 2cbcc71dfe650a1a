//! The caller's environment (hardening 8 and 9): the claim never changes a
//! session setting of a pooled connection (on the won, lost, error and
//! cancelled paths), the handler sees the session's own settings, and the
//! claimed transaction runs at the isolation level the layer was given.
//! One connection per pool, so every check reads the connection the layer
//! used.

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use sqlx::Pool;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::testkit::{Cleanup, ConformanceDb};
use tower_idempotency::{IdempotencyBody, IdempotencyLayer, IsolationLevel, Principal, Tx};

fn request(key: &str) -> Request<String> {
    request_as("p", key)
}

fn request_as(principal: &str, key: &str) -> Request<String> {
    let mut req = Request::post("/x")
        .header("idempotency-key", key)
        .body(String::new())
        .unwrap();
    req.extensions_mut().insert(Principal::new(principal));
    req
}

/// Sends one request of `principal` per key of `keys`, in order, through
/// `service`; each answer's status and body.
async fn send_keys<S, B>(service: S, principal: &str, keys: &[&str]) -> Vec<(StatusCode, String)>
where
    S: tower::Service<Request<String>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let mut answers = Vec::new();
    for key in keys {
        let res = service
            .clone()
            .oneshot(request_as(principal, key))
            .await
            .unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        answers.push((status, String::from_utf8_lossy(&body).into_owned()));
    }
    answers
}

/// Runs one request through a layer whose handler answers with `probe`'s
/// single text value, read on the claimed transaction.
macro_rules! call {
    ($db:ty, $layer:expr, $key:expr, $probe:expr) => {{
        let probe: &'static str = $probe;
        let layer = $layer;
        let handler = move |req: Request<IdempotencyBody<String>>| async move {
            let tx = req.extensions().get::<Tx<$db>>().cloned().unwrap();
            let mut conn = tx.lock().unwrap();
            let value: String = sqlx::query_scalar(probe)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            Ok::<_, Infallible>(Response::builder().status(201).body(value).unwrap())
        };
        async move {
            let res = ServiceBuilder::new()
                .layer(layer)
                .service_fn(handler)
                .oneshot(request($key))
                .await
                .unwrap();
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    }};
}

/// A pool of one connection, set up by `setup` when it connects.
macro_rules! one_connection_pool {
    ($db:ty, $url:expr, $setup:expr) => {{
        let setup: &'static str = $setup;
        sqlx::pool::PoolOptions::<$db>::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                Box::pin(async move { sqlx::raw_sql(setup).execute(conn).await.map(drop) })
            })
            .connect($url)
            .await
            .unwrap()
    }};
}

/// Every path the claim can take, then the pooled connection's setting.
macro_rules! settings_survive_every_path {
    ($db:ty, $setup:expr, $probe:expr, $expected:expr) => {{
        let probe: &'static str = $probe;
        let expected: &str = $expected;
        let (url, _drop): (String, Cleanup) = <$db as ConformanceDb>::fresh_url().await;
        let pool: Pool<$db> = one_connection_pool!($db, &url, $setup);
        tower_idempotency::migrate(&pool).await.unwrap();
        let layer = || {
            IdempotencyLayer::new(pool.clone())
                .unscoped()
                .with_in_flight_wait(Duration::from_millis(1500))
        };
        let session = || async {
            sqlx::query_scalar::<_, String>(probe)
                .fetch_one(&pool)
                .await
                .unwrap()
        };

        // Won: the handler sees the session's own value.
        let (status, seen) = call!($db, layer(), "won", probe).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(seen, expected, "the handler's lock wait is the session's");
        assert_eq!(session().await, expected, "after a won claim");
        // Lost: a replay.
        let (status, _) = call!($db, layer(), "won", probe).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(session().await, expected, "after a lost claim");
        // Error: the key is held by a stuck claim on another pool; the
        // claim times out on its lock.
        let other = sqlx::pool::PoolOptions::<$db>::new()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        let stuck = <$db as ConformanceDb>::hold_claim(&other, "", "POST /x", "stuck").await;
        let (status, _) = call!($db, layer(), "stuck", probe).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(session().await, expected, "after a lock timeout");
        // Cancelled mid-claim: the client goes away while the claim waits.
        let cut = tokio::time::timeout(
            Duration::from_millis(20),
            call!($db, layer(), "stuck", probe),
        )
        .await;
        assert!(cut.is_err());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(session().await, expected, "after a cancelled claim");
        stuck.rollback().await.unwrap();
        let (status, seen) = call!($db, layer(), "stuck", probe).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(seen, expected);
        assert_eq!(session().await, expected, "at the end");
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lock_timeout_is_the_sessions_on_every_path() {
    settings_survive_every_path!(
        sqlx::Postgres,
        "SET lock_timeout = '3s'",
        "SELECT current_setting('lock_timeout')",
        "3s"
    );
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_lock_wait_is_the_sessions_on_every_path() {
    settings_survive_every_path!(
        sqlx::MySql,
        "SET SESSION innodb_lock_wait_timeout = 7",
        "SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS CHAR)",
        "7"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_runs_the_claimed_transaction_at_the_chosen_level() {
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let pool: Pool<sqlx::Postgres> = one_connection_pool!(sqlx::Postgres, &url, "SELECT 1");
    tower_idempotency::migrate(&pool).await.unwrap();
    let probe = "SELECT current_setting('transaction_isolation')";
    let layer = IdempotencyLayer::new(pool.clone()).unscoped();
    assert_eq!(
        call!(sqlx::Postgres, layer.clone(), "a", probe).await.1,
        "read committed"
    );
    for (level, name) in [
        (IsolationLevel::RepeatableRead, "repeatable read"),
        (IsolationLevel::Serializable, "serializable"),
    ] {
        let key = name.replace(' ', "-");
        let (status, seen) = call!(
            sqlx::Postgres,
            layer.clone().with_isolation_level(level),
            &key,
            probe
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(seen, name);
    }
    // The session's own default is untouched.
    let session: String = sqlx::query_scalar(probe).fetch_one(&pool).await.unwrap();
    assert_eq!(session, "read committed");
}

/// Write skew under SERIALIZABLE: two doctors each go off call if another
/// is still on call. Both write before either commits, so one transaction
/// must fail when it records or commits; the layer answers it `503`
/// transaction-conflict with `Retry-After`, and nothing of it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_serialization_failure_at_commit_is_a_retryable_503() {
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE doctors (id INT PRIMARY KEY, on_call BOOL NOT NULL);
         INSERT INTO doctors VALUES (1, true), (2, true);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let layer = IdempotencyLayer::new(pool.clone())
        .unscoped()
        .with_isolation_level(IsolationLevel::Serializable);
    let both_wrote = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let handler = move |req: Request<IdempotencyBody<String>>| {
        let both_wrote = std::sync::Arc::clone(&both_wrote);
        async move {
            let me: i32 = req.uri().path().trim_start_matches('/').parse().unwrap();
            let tx = req
                .extensions()
                .get::<Tx<sqlx::Postgres>>()
                .cloned()
                .unwrap();
            let mut conn = tx.lock().unwrap();
            let on_call: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM doctors WHERE on_call")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            if on_call < 2 {
                return Ok::<_, Infallible>(
                    Response::builder().status(409).body(String::new()).unwrap(),
                );
            }
            sqlx::query("UPDATE doctors SET on_call = false WHERE id = $1")
                .bind(me)
                .execute(&mut *conn)
                .await
                .unwrap();
            drop(conn);
            both_wrote.wait().await;
            Ok(Response::builder()
                .status(201)
                .body(format!("{me} off call"))
                .unwrap())
        }
    };
    let service = ServiceBuilder::new().layer(layer).service_fn(handler);
    let go = |me: i32| {
        let service = service.clone();
        async move {
            let mut req = Request::post(format!("/{me}"))
                .header("idempotency-key", format!("off-{me}"))
                .body(String::new())
                .unwrap();
            req.extensions_mut().insert(Principal::new("p"));
            service.oneshot(req).await.unwrap()
        }
    };
    let (a, b) = tokio::join!(go(1), go(2));
    let mut statuses = [a.status(), b.status()];
    statuses.sort();
    assert_eq!(
        statuses,
        [StatusCode::CREATED, StatusCode::SERVICE_UNAVAILABLE]
    );
    let failed = if a.status() == StatusCode::SERVICE_UNAVAILABLE {
        a
    } else {
        b
    };
    assert!(failed.headers().contains_key("retry-after"));
    let body = failed.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("#transaction-conflict"),
        "{body:?}"
    );
    let off: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM doctors WHERE NOT on_call")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(off, 1, "exactly one doctor went off call");
    let ledger: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ledger, 1, "the conflicting request left no record");
}

/// Issue 33, point 1: a session whose statements take long between their
/// snapshot and their first function call (here JIT compilation on every
/// statement, `jit_above_cost = 0`, as a session may set) makes the race
/// of a duplicate's `BEGIN` with the first request's `COMMIT` wide: at
/// `REPEATABLE READ` and `SERIALIZABLE` the duplicate must still find the
/// committed row and never run the handler again (before: it took the
/// released lock on a snapshot from before the commit, and ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stricter_isolation_sees_the_commit_it_waited_for() {
    use tower_idempotency::testkit::{Harness, cases};
    let h = Harness::<sqlx::Postgres>::new().await;
    let options = (*h.pool.connect_options()).clone();
    let slow_plans = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql(
                    "SET jit_above_cost = 0; SET jit_inline_above_cost = 0; \
                     SET jit_optimize_above_cost = 0",
                )
                .execute(conn)
                .await
                .map(drop)
            })
        })
        .connect_with(options)
        .await
        .unwrap();
    cases::stricter_isolation_storms(h.with_pool(slow_plans), 3).await;
}

/// A temporary table named like the ledger, left on a pooled connection by
/// a handler, comes first on that session's `search_path` (`pg_temp` is
/// searched before every schema). The claim's read names the ledger's
/// schema, found once per layer, so it never reads the temporary table
/// (before: the next claim on that connection read the empty temporary
/// table, ran the handler of a finished key again, and its row then met
/// the real one: a second execution and a `503` instead of the replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_temporary_table_never_captures_the_ledger() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let pool: Pool<sqlx::Postgres> = one_connection_pool!(sqlx::Postgres, &url, "SELECT 1");
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id SERIAL PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |req: Request<IdempotencyBody<String>>| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let tx = req
                    .extensions()
                    .get::<Tx<sqlx::Postgres>>()
                    .cloned()
                    .unwrap();
                let mut conn = tx.lock().unwrap();
                let id: i32 = sqlx::query_scalar("INSERT INTO orders DEFAULT VALUES RETURNING id")
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                sqlx::raw_sql(
                    "CREATE TEMP TABLE IF NOT EXISTS idempotency_records \
                     (LIKE public.idempotency_records INCLUDING ALL)",
                )
                .execute(&mut *conn)
                .await
                .unwrap();
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(201)
                        .body(format!("order {id}"))
                        .unwrap(),
                )
            }
        }
    };
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .service_fn(handler);
    let answers = send_keys(service, "p", &["k-1", "k-1", "k-1", "k-2", "k-2"]).await;
    assert_eq!(answers[0].0, StatusCode::CREATED, "{answers:?}");
    assert!(answers[..3].iter().all(|a| a == &answers[0]), "{answers:?}");
    assert_eq!(answers[3].0, StatusCode::CREATED, "{answers:?}");
    assert!(answers[3] != answers[0], "{answers:?}");
    assert_eq!(answers[4], answers[3], "{answers:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one execution per key");
    let count = |sql| <sqlx::Postgres as ConformanceDb>::count(&pool, sql);
    assert_eq!(count("SELECT COUNT(*) FROM public.orders").await, 2);
    assert_eq!(
        count("SELECT COUNT(*) FROM public.idempotency_records").await,
        2
    );
}

/// Issue 33, point 2: a schema-per-tenant service whose handlers run
/// `SET LOCAL search_path TO tenant_42, public` (the tenant's schema has a
/// ledger table of its own) keeps every answer in the ledger the claims
/// read: the key replays, the handler runs once, and the tenant's table
/// stays empty (before: the finished row went to `tenant_42`, every retry
/// ran the handler again and was refused `503`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_handlers_search_path_never_moves_the_ledger() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE SCHEMA tenant_42; CREATE TABLE orders (id SERIAL PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    // The tenant's schema migrated too, as a schema-per-tenant service does.
    let tenant = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql("SET search_path TO tenant_42")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&url)
        .await
        .unwrap();
    tower_idempotency::migrate(&tenant).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |req: Request<IdempotencyBody<String>>| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let tx = req
                    .extensions()
                    .get::<Tx<sqlx::Postgres>>()
                    .cloned()
                    .unwrap();
                let mut conn = tx.lock().unwrap();
                sqlx::raw_sql("SET LOCAL search_path TO tenant_42, public")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                let id: i32 = sqlx::query_scalar("INSERT INTO orders DEFAULT VALUES RETURNING id")
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(201)
                        .body(id.to_string())
                        .unwrap(),
                )
            }
        }
    };
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .service_fn(handler);
    let answers = send_keys(service, "p", &["tenant-key"; 3]).await;
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    assert_eq!(answers[0].0, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one execution");
    let count = |sql| <sqlx::Postgres as ConformanceDb>::count(&pool, sql);
    assert_eq!(count("SELECT COUNT(*) FROM public.orders").await, 1);
    assert_eq!(
        count("SELECT COUNT(*) FROM public.idempotency_records").await,
        1
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM tenant_42.idempotency_records").await,
        0
    );
}

/// Issue 33, point 4b: a `TEMP` table named `idempotency_records`, left on
/// a pooled SQLite connection by a handler (SQLite resolves unqualified
/// names to `temp` first), never captures the layer's statements: the key
/// replays, the handler runs once, and the real ledger holds `SUCCEEDED`
/// (before: the real row stayed `PROCESSING`, retries got `503`).
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_temporary_table_never_captures_the_ledger() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (url, _drop) = <sqlx::Sqlite as ConformanceDb>::fresh_url().await;
    let url = format!("{url}?mode=rwc");
    let pool: Pool<sqlx::Sqlite> = one_connection_pool!(sqlx::Sqlite, &url, "SELECT 1");
    tower_idempotency::migrate(&pool).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |req: Request<IdempotencyBody<String>>| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let tx = req.extensions().get::<Tx<sqlx::Sqlite>>().cloned().unwrap();
                let mut conn = tx.lock().unwrap();
                sqlx::raw_sql(
                    "CREATE TEMP TABLE IF NOT EXISTS idempotency_records \
                     AS SELECT * FROM main.idempotency_records WHERE 0",
                )
                .execute(&mut *conn)
                .await
                .unwrap();
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(201)
                        .body("made".to_owned())
                        .unwrap(),
                )
            }
        }
    };
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()).unscoped())
        .service_fn(handler);
    let answers = send_keys(
        service,
        "p",
        &["temp-1", "temp-1", "temp-2", "temp-1", "temp-2"],
    )
    .await;
    assert!(
        answers
            .iter()
            .all(|a| a.0 == StatusCode::CREATED && a.1 == "made"),
        "{answers:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one execution per key");
    let succeeded = <sqlx::Sqlite as ConformanceDb>::count(
        &pool,
        "SELECT COUNT(*) FROM main.idempotency_records WHERE status = 'SUCCEEDED'",
    )
    .await;
    assert_eq!(succeeded, 2);
}

/// Issue 33, point 4b (MySQL/MariaDB): on a pool of one connection, a
/// handler inserts an order on the claimed transaction, then runs
/// `statement` (a session setting, which persists on the connection after
/// the request). The same key is sent `tries` times by a non-ASCII
/// principal, then once more by the same principal under a fresh key.
/// Judged by the rows committed: one order and one `SUCCEEDED` row per
/// key, every answer of a key the first one (a replay), and no answer ever
/// says "nothing was recorded" about a key whose row committed.
#[cfg(feature = "mysql")]
async fn mysql_session_keeps_the_ledger(statement: &'static str) -> Vec<(StatusCode, String)> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (url, _drop) = <sqlx::MySql as ConformanceDb>::fresh_url().await;
    let pool: Pool<sqlx::MySql> = one_connection_pool!(sqlx::MySql, &url, "SELECT 1");
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .unwrap();
    let db: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |req: Request<IdempotencyBody<String>>| {
            let runs = Arc::clone(&runs);
            let db = db.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let tx = req.extensions().get::<Tx<sqlx::MySql>>().cloned().unwrap();
                let mut conn = tx.lock().unwrap();
                // Qualified: the statement may be a `USE`.
                let insert = format!("INSERT INTO `{db}`.orders () VALUES ()");
                let done = sqlx::raw_sql(sqlx::AssertSqlSafe(insert))
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                sqlx::raw_sql(statement).execute(&mut *conn).await.unwrap();
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(201)
                        .body(format!("order {}", done.last_insert_id()))
                        .unwrap(),
                )
            }
        }
    };
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(pool.clone()))
        .service_fn(handler);
    let principal = "Jos\u{e9} M\u{fc}ller \u{5c71}\u{7530}";
    let answers = send_keys(service, principal, &["k-1", "k-1", "k-1", "k-2", "k-2"]).await;
    // The pooled connection is never left inside a transaction.
    let open: i64 = sqlx::query_scalar(
        "SET STATEMENT sql_select_limit = DEFAULT FOR SELECT CAST(@@in_transaction AS SIGNED)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        open, 0,
        "{statement}: the pooled connection is in a transaction"
    );
    // Judged on a connection in the server's default session.
    let judge = sqlx::MySqlPool::connect(&url).await.unwrap();
    let count = |sql| <sqlx::MySql as ConformanceDb>::count(&judge, sql);
    let orders = count("SELECT COUNT(*) FROM orders").await;
    let succeeded =
        count("SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'").await;
    assert!(
        orders <= 2,
        "{statement}: {orders} orders for two keys: {answers:?}"
    );
    assert_eq!(
        orders,
        i64::try_from(runs.load(Ordering::SeqCst)).unwrap(),
        "{statement}: every execution committed: {answers:?}"
    );
    for (i, (status, body)) in answers.iter().enumerate() {
        assert!(
            !body.contains("nothing was recorded") || orders == 0,
            "{statement}: answer {i} says nothing was recorded, but {orders} orders committed: {answers:?}"
        );
        let _ = status;
    }
    assert_eq!(
        succeeded, orders,
        "{statement}: a row per order: {answers:?}"
    );
    answers
}

/// The whole promise: one order per key, and every retry the replay.
#[cfg(feature = "mysql")]
async fn mysql_session_is_immune(statement: &'static str) {
    let answers = mysql_session_keeps_the_ledger(statement).await;
    assert_eq!(
        answers[0].0,
        StatusCode::CREATED,
        "{statement}: {answers:?}"
    );
    assert!(
        answers[..3].iter().all(|a| a == &answers[0]),
        "{statement}: {answers:?}"
    );
    assert_eq!(
        answers[3].0,
        StatusCode::CREATED,
        "{statement}: {answers:?}"
    );
    assert!(answers[3] != answers[0], "{statement}: {answers:?}");
    assert_eq!(answers[4], answers[3], "{statement}: {answers:?}");
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_client_character_set_never_hides_the_ledger() {
    for statement in [
        "SET NAMES latin1",
        "SET NAMES big5",
        "SET NAMES sjis",
        "SET character_set_client = latin1",
        "SET character_set_connection = sjis",
    ] {
        mysql_session_is_immune(statement).await;
    }
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_results_character_set_never_hides_the_ledger() {
    for statement in [
        "SET NAMES binary",
        "SET character_set_results = utf16",
        "SET character_set_results = latin1",
        "SET character_set_results = NULL",
    ] {
        mysql_session_is_immune(statement).await;
    }
}

/// `sql_select_limit = 0` once hid the finish batch's read (the batch
/// committed, then the read found no row: "nothing was recorded"), and
/// every retry's read of the ledger (`409 #unconfirmed`).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_select_limit_never_hides_the_ledger() {
    for statement in ["SET sql_select_limit = 0", "SET sql_select_limit = 1"] {
        mysql_session_is_immune(statement).await;
    }
}

/// `completion_type = CHAIN` once turned the layer's `COMMIT`, and sqlx's
/// `ROLLBACK` after it, into ones that open the next transaction: the
/// pooled connection went back inside a transaction, and every later claim
/// on it failed (`503`). `RELEASE` would end the connection.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_completion_type_never_chains_the_ledger() {
    for statement in [
        "SET completion_type = 'CHAIN'",
        "SET completion_type = 'RELEASE'",
    ] {
        mysql_session_is_immune(statement).await;
    }
}

/// A session left read-only (`SET SESSION TRANSACTION READ ONLY`,
/// `tx_read_only`) once refused every later claim on that connection
/// (`503`): the claimed transaction is `READ WRITE` on its own, so the
/// layer and the handler's writes on it are immune.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_read_only_session_never_refuses_the_claim() {
    for statement in [
        "SET SESSION TRANSACTION READ ONLY",
        "SET SESSION tx_read_only = 1",
    ] {
        mysql_session_is_immune(statement).await;
    }
}

/// A `TEMPORARY` table named like the ledger shadows the table on its
/// connection, qualified or not (MariaDB resolves `db.name` to the
/// temporary table first). Before: a retry on that connection won a
/// second claim in the temporary table, and one key committed a second
/// order. The layer's statements name the table `tower_idempotency_records`
/// (a view of it keeps the old name), which the temporary table never
/// shadows.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_temporary_table_never_captures_the_ledger() {
    mysql_session_is_immune(
        "CREATE TEMPORARY TABLE IF NOT EXISTS idempotency_records \
         SELECT * FROM idempotency_records WHERE 0 = 1",
    )
    .await;
}

/// A handler's `USE` changes the connection's database for the rest of
/// its life in the pool. Every ledger statement names the database the
/// pool's connect options name, so the ledger never moves (before: the
/// next claim on that connection read and wrote another database's ledger,
/// or failed for want of one).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_handlers_use_never_moves_the_ledger() {
    mysql_session_is_immune("USE test").await;
}

/// The operator's world: an upgrade to MySQL/MariaDB's ledger v8 renames
/// the table, which waits for every transaction that has used it while
/// every new ledger statement queues behind the rename. `migrate()` bounds
/// that wait (10 s), fails with the lock wait, and leaves the ledger as it
/// was; the next `migrate()` finishes the upgrade. (Before: it waited for
/// the server's `lock_wait_timeout`, a day on MariaDB, and the ledger with
/// it.)
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_an_upgrade_waits_a_bounded_time_behind_a_long_transaction() {
    let (url, _drop) = <sqlx::MySql as ConformanceDb>::fresh_url().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    // Back to ledger v7: the table under its old name, v7's view on it.
    sqlx::raw_sql(
        "DROP VIEW idempotency_records; DROP VIEW tower_idempotency_ledger; \
         RENAME TABLE tower_idempotency_records TO idempotency_records; \
         CREATE VIEW tower_idempotency_ledger AS SELECT * FROM idempotency_records; \
         DELETE FROM tower_idempotency_migrations WHERE version = 8",
    )
    .execute(&pool)
    .await
    .unwrap();
    let base_table = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT table_type FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = 'idempotency_records'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == "BASE TABLE"
    };
    let mut long = pool.begin().await.unwrap();
    sqlx::query("SELECT COUNT(*) FROM idempotency_records")
        .execute(&mut *long)
        .await
        .unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(40), tower_idempotency::migrate(&pool))
        .await
        .expect("migrate() waited behind the transaction without a bound");
    let error = waited.expect_err("the rename cannot run while a transaction holds the table");
    assert!(error.to_string().contains("Lock wait timeout"), "{error}");
    assert!(base_table().await, "the failed upgrade moved nothing");
    long.commit().await.unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    assert!(
        !base_table().await,
        "the next migrate() finished the upgrade"
    );
    let versions: i64 = sqlx::query_scalar("SELECT MAX(version) FROM tower_idempotency_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(versions, 8);
}

/// The operator's world: MySQL's DDL commits statement by statement, and
/// `migrate()` records a version after its statements ran, so a migration
/// can stop after its last statement and before its version is recorded (a
/// killed process, a lost connection). Each MySQL/MariaDB migration, found
/// applied but not recorded, is run again by the next `migrate()`, which
/// ends at the last version with every column in place. (Before: versions 4
/// and 5 failed again on every `migrate()` with "Duplicate column name",
/// and the upgrade needed a hand-written fix.)
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_migration_applied_but_unrecorded_runs_again() {
    const FILES: [&str; 8] = [
        include_str!("../migrations/mysql/0001_idempotency_records.sql"),
        include_str!("../migrations/mysql/0002_byte_scopes_and_reconciliation.sql"),
        include_str!("../migrations/mysql/0003_tombstone_purge_time.sql"),
        include_str!("../migrations/mysql/0004_lease_mode.sql"),
        include_str!("../migrations/mysql/0005_claim_fence.sql"),
        include_str!("../migrations/mysql/0006_operator_audit.sql"),
        include_str!("../migrations/mysql/0007_ledger_view.sql"),
        include_str!("../migrations/mysql/0008_ledger_table_name.sql"),
    ];
    for stopped in 1..=FILES.len() {
        let (url, _drop) = <sqlx::MySql as ConformanceDb>::fresh_url().await;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE tower_idempotency_migrations (version BIGINT PRIMARY KEY, \
             name VARCHAR(255) NOT NULL, applied_at BIGINT NOT NULL) ENGINE = InnoDB",
        )
        .execute(&pool)
        .await
        .unwrap();
        for (i, sql) in FILES[..stopped].iter().enumerate() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(*sql))
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("migration {}: {e}", i + 1));
            // The stopped one ran whole; its version was never recorded.
            if i + 1 < stopped {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO tower_idempotency_migrations VALUES ({}, 'by hand', 0)",
                    i + 1
                )))
                .execute(&pool)
                .await
                .unwrap();
            }
        }
        tower_idempotency::migrate(&pool)
            .await
            .unwrap_or_else(|e| panic!("migration {stopped}, applied but unrecorded: {e}"));
        let versions: (i64, i64) =
            sqlx::query_as("SELECT COUNT(*), MAX(version) FROM tower_idempotency_migrations")
                .fetch_one(&pool)
                .await
                .unwrap();
        let last = FILES.len() as i64;
        assert_eq!(versions, (last, last), "migration {stopped}");
        let lease_index: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.statistics \
             WHERE table_schema = DATABASE() AND table_name = 'tower_idempotency_records' \
             AND index_name = 'idempotency_records_lease'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(lease_index > 0, "migration {stopped}: v4's index");
        // The last version's columns, through the view operators use.
        sqlx::query(
            "SELECT generation, locked_until, recovery_point, recovery_data, pending_step, \
             claim_id, parks, pending_until FROM idempotency_records",
        )
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("migration {stopped}: {e}"));
    }
}
