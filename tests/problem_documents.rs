//! Issue 34, points 4 and 7: every refusal is an RFC 9457 problem document
//! that names its occurrence (`instance`, also in the layer's log line), says
//! whether the same request may be retried with the same key (`retryable`),
//! names the key it is about (`idempotency_key`) and the IETF draft's section
//! it rests on (`spec`); and a handler written with `?` on both sqlx's
//! errors and the transaction's needs no error type of its own
//! ([`HandlerError`]). Judged by rows committed, on in-memory SQLite.

use std::io::Write;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{Pool, Sqlite};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{HandlerError, IdempotencyLayer, Principal, Tx};

/// A slow handler says it runs, then waits to be released.
static STARTED: LazyLock<Notify> = LazyLock::new(Notify::new);
static RELEASE: LazyLock<Notify> = LazyLock::new(Notify::new);

const DRAFT: &str =
    "https://datatracker.ietf.org/doc/html/draft-ietf-httpapi-idempotency-key-header-07";

async fn pool() -> Pool<Sqlite> {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    tower_idempotency::migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    pool
}

async fn count(pool: &Pool<Sqlite>, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The handler a newcomer writes: `?` on the lock and on every query, and
/// a business refusal wrapped as the crate's error.
async fn create_order(
    tx: Tx<Sqlite>,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), HandlerError> {
    let mut conn = tx.lock()?;
    let amount = body["amount"].as_i64().unwrap_or(0);
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (amount) VALUES (?) RETURNING id")
        .bind(amount)
        .fetch_one(&mut *conn)
        .await?;
    if body["fail"] == "sql" {
        // A statement that fails: its text must never reach the client.
        sqlx::query("SELECT secret_column FROM no_such_table")
            .execute(&mut *conn)
            .await?;
    }
    if body["fail"] == "twice" {
        let _second = tx.lock()?;
    }
    if amount > 1000 {
        // A final business error: rolled back to the claim's savepoint,
        // recorded as FAILED_FINAL.
        let problem = json!({"type": "https://example.test/problems/over-limit", "status": 409});
        return Err(HandlerError::from_response((
            StatusCode::CONFLICT,
            Json(problem),
        )));
    }
    if body["slow"] == true {
        // Holds its claim until the test has seen the duplicate refused.
        STARTED.notify_one();
        RELEASE.notified().await;
    }
    Ok((StatusCode::CREATED, Json(json!({"orderId": id}))))
}

fn app(pool: &Pool<Sqlite>) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::new(pool.clone()).with_in_flight_wait(Duration::from_millis(20)))
        // Added after the layer: not covered by it.
        .route("/late", post(create_order))
}

fn order(key: Option<&str>, body: Value) -> Request<Body> {
    let mut req = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let mut req = req.body(Body::from(body.to_string())).unwrap();
    req.extensions_mut().insert(Principal::new("alice"));
    req
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, String, Value) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let content_type = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let doc = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, content_type, doc)
}

/// The problem document's `type` fragment.
fn slug(doc: &Value) -> &str {
    doc["type"].as_str().unwrap().rsplit('#').next().unwrap()
}

/// A tracing subscriber that writes into a buffer, for the log lines.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn is_urn_uuid(instance: &Value) -> bool {
    let Some(s) = instance.as_str() else {
        return false;
    };
    let Some(uuid) = s.strip_prefix("urn:uuid:") else {
        return false;
    };
    let groups: Vec<&str> = uuid.split('-').collect();
    groups.iter().map(|g| g.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && uuid.chars().all(|c| c == '-' || c.is_ascii_hexdigit())
}

#[tokio::test]
async fn each_refusal_names_its_occurrence_its_key_its_retry_and_the_drafts_section() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let pool = pool().await;
    let app = app(&pool);

    // No key: nothing to name.
    let (status, ct, missing) = send(&app, order(None, json!({"amount": 10}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(slug(&missing), "missing-key");
    assert_eq!(missing["retryable"], false);
    assert!(missing.get("idempotency_key").is_none(), "{missing}");
    assert_eq!(missing["spec"], format!("{DRAFT}#section-2.1"));
    assert!(is_urn_uuid(&missing["instance"]), "{missing}");

    // A malformed key is never echoed.
    let (status, _, malformed) = send(&app, order(Some("\"open"), json!({"amount": 10}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(slug(&malformed), "malformed-key");
    assert!(malformed.get("idempotency_key").is_none(), "{malformed}");
    assert_eq!(malformed["spec"], format!("{DRAFT}#section-2.1"));
    assert_eq!(malformed["retryable"], false);

    // The same key with another payload: named (as the client sent it,
    // unquoted), not retryable, section 2.2.
    let (status, _, _) = send(&app, order(Some("\"k-1\""), json!({"amount": 10}))).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, reused) = send(&app, order(Some("\"k-1\""), json!({"amount": 11}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(slug(&reused), "key-reused");
    assert_eq!(reused["idempotency_key"], "k-1");
    assert_eq!(reused["retryable"], false);
    assert_eq!(reused["spec"], format!("{DRAFT}#section-2.2"));
    assert_eq!(reused["status"], 422);

    // A duplicate while the first is still running: retryable, section 2.6.
    let slow = json!({"amount": 12, "slow": true});
    let first = tokio::spawn(app.clone().oneshot(order(Some("k-2"), slow.clone())));
    STARTED.notified().await;
    let (status, _, in_flight) = send(&app, order(Some("k-2"), slow.clone())).await;
    RELEASE.notify_one();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(slug(&in_flight), "in-flight", "{in_flight}");
    assert_eq!(in_flight["idempotency_key"], "k-2");
    assert_eq!(in_flight["retryable"], true);
    assert_eq!(in_flight["spec"], format!("{DRAFT}#section-2.6"));
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);

    // Each occurrence has its own instance, and each is in the log.
    let instances: Vec<&str> = [&missing, &malformed, &reused, &in_flight]
        .iter()
        .map(|d| d["instance"].as_str().unwrap())
        .collect();
    let mut unique = instances.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), instances.len(), "{instances:?}");
    let text = logs.text();
    for instance in instances {
        assert!(text.contains(instance), "{instance} not logged:\n{text}");
    }
    // The key itself is never logged.
    assert!(!text.contains("k-1"), "{text}");
    // Rows: the two orders that ran, no more.
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM orders").await, 2);
}

#[tokio::test]
async fn a_handler_uses_question_mark_on_sqlx_and_tx_errors() {
    let pool = pool().await;
    let app = app(&pool);

    // Success: the order and its ledger row commit together.
    let (status, _, doc) = send(&app, order(Some("ok"), json!({"amount": 5}))).await;
    assert_eq!(status, StatusCode::CREATED, "{doc}");

    // A failing statement: 500 problem, the SQL text stays in the log,
    // nothing of the request commits, and the key stays usable.
    let (status, ct, doc) = send(
        &app,
        order(Some("sql"), json!({"amount": 6, "fail": "sql"})),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(slug(&doc), "database-error");
    assert_eq!(doc["retryable"], false);
    assert!(is_urn_uuid(&doc["instance"]), "{doc}");
    let text = doc.to_string();
    assert!(
        !text.contains("no_such_table") && !text.contains("secret_column"),
        "{text}"
    );

    // A second lock of the transaction: TxError through `?`.
    let (status, ct, doc) = send(
        &app,
        order(Some("twice"), json!({"amount": 7, "fail": "twice"})),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(slug(&doc), "transaction-busy");
    assert_eq!(doc["retryable"], false);

    // A business refusal wrapped with `from_response`: its own answer,
    // recorded as final, its order rolled back.
    let (status, ct, doc) = send(&app, order(Some("big"), json!({"amount": 5000}))).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(ct, "application/json");
    assert_eq!(doc["type"], "https://example.test/problems/over-limit");

    assert_eq!(count(&pool, "SELECT COUNT(*) FROM orders").await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE status = 'SUCCEEDED'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE status = 'FAILED_FINAL'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&pool, "SELECT COUNT(*) FROM idempotency_records").await,
        2
    );
}

#[tokio::test]
async fn tx_on_a_route_the_layer_does_not_cover_is_a_problem() {
    let pool = pool().await;
    let app = app(&pool);
    let mut req = order(Some("late"), json!({"amount": 1}));
    *req.uri_mut() = "/late".parse().unwrap();
    let (status, ct, doc) = send(&app, req).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(slug(&doc), "transaction-missing");
    assert_eq!(doc["retryable"], false);
    assert!(is_urn_uuid(&doc["instance"]), "{doc}");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM orders").await, 0);
}

#[test]
fn every_tx_error_answers_problem_json() {
    use tower_idempotency::TxError;
    for (err, slug_) in [
        (TxError::Missing, "transaction-missing"),
        (TxError::Busy, "transaction-busy"),
        (TxError::Finished, "transaction-finished"),
    ] {
        let res = err.into_response();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(res.headers()["content-type"], "application/problem+json");
        let bytes = futures_executor(res.into_body());
        let doc: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(slug(&doc), slug_);
        assert_eq!(doc["retryable"], false);
    }
}

fn futures_executor(body: Body) -> bytes::Bytes {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(body.collect())
        .unwrap()
        .to_bytes()
}

/// PostgreSQL reads a unique violation (23505) on the ledger as a lost race
/// (retryable); in a handler it is a business conflict: final, `500`.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_handlers_unique_violation_on_postgres_is_final() {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/test")
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TEMP TABLE emails (address TEXT PRIMARY KEY); INSERT INTO emails VALUES ('a@example.test')")
        .execute(&mut conn)
        .await
        .unwrap();
    let err = sqlx::query("INSERT INTO emails VALUES ('a@example.test')")
        .execute(&mut conn)
        .await
        .unwrap_err();
    let res = HandlerError::from(err).into_response();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let doc: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(slug(&doc), "database-error");
    assert_eq!(doc["retryable"], false);
    assert!(!doc.to_string().contains("a@example.test"), "{doc}");
}

/// A server that refuses writes for now (a standby, a demoted leader, a
/// replica made read-only during a switchover: SQLSTATE `25006` on
/// PostgreSQL, error 1792 or 1290 on MySQL/MariaDB) is transient: the
/// handler's `?` answers a retryable `503` with `Retry-After`, never a
/// final `500` (issue 36).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[tokio::test]
async fn a_read_only_server_is_a_retryable_503() {
    use sqlx::Connection;
    let mut errors = Vec::new();
    #[cfg(feature = "postgres")]
    {
        let mut conn = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/test")
            .await
            .unwrap();
        let err = sqlx::raw_sql("BEGIN READ ONLY; CREATE TABLE read_only_probe (a INT)")
            .execute(&mut conn)
            .await
            .unwrap_err();
        errors.push(("postgres", err));
    }
    #[cfg(feature = "mysql")]
    {
        let mut conn = sqlx::MySqlConnection::connect("mysql://root@127.0.0.1:3306/test")
            .await
            .unwrap();
        let err = sqlx::raw_sql(
            "START TRANSACTION READ ONLY; CREATE TEMPORARY TABLE read_only_probe (a INT)",
        )
        .execute(&mut conn)
        .await
        .unwrap_err();
        errors.push(("mysql", err));
    }
    for (store, err) in errors {
        let res = HandlerError::from(err).into_response();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{store}");
        assert!(
            res.headers().contains_key(http::header::RETRY_AFTER),
            "{store}"
        );
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        let doc: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(doc["retryable"], true, "{store}: {doc}");
    }
}
