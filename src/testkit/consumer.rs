//! The message consumer's conformance cases: the processed-message row and
//! the business write (an `orders` row) commit together, once per
//! `(subscriber, message id)`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{ConformanceDb, Harness};
use crate::Sweeper;
use crate::consumer::{ConsumeError, Consumer, Message, Processed};

const PAYLOAD: &[u8] = br#"{"orderId":"o-1","sku":"sku-1","qty":2}"#;

type Outcome = Result<Processed<i64>, ConsumeError<sqlx::Error>>;

/// One delivery whose effect is one `orders` row; counts handler runs.
async fn deliver<DB: ConformanceDb>(
    consumer: &Consumer<DB>,
    runs: &AtomicUsize,
    id: &str,
    payload: &[u8],
) -> Outcome {
    consumer
        .process(id, payload, |tx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let mut conn = tx.lock().expect("the transaction");
            DB::insert_order(&mut conn, "consumer", 2).await
        })
        .await
}

/// Case: a first delivery applies once; a duplicate delivery skips the
/// handler; the same payload spelled differently is the same payload.
pub async fn consumer_applies_once_and_skips_duplicates<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    let first = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(first, Ok(Processed::Applied(_))), "{first:?}");
    let again = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(again, Ok(Processed::Duplicate)), "{again:?}");
    let respelled = br#"{ "qty": 2, "sku": "sku-1", "orderId": "o-1" }"#;
    let again = deliver(&consumer, &runs, "evt-1", respelled).await;
    assert!(matches!(again, Ok(Processed::Duplicate)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
    // Ids are per subscriber: another subscriber processes the same id.
    let other = Consumer::new(h.pool.clone(), "billing");
    let theirs = deliver(&other, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(theirs, Ok(Processed::Applied(_))), "{theirs:?}");
    assert_eq!(h.orders().await, 2);
    // An empty id is refused before anything happens.
    let empty = deliver(&consumer, &runs, "", PAYLOAD).await;
    assert!(matches!(empty, Err(ConsumeError::InvalidId)), "{empty:?}");
}

/// Case: a handler error rolls back both the effect and the id, so the
/// redelivery runs it again and applies once; a panic likewise.
pub async fn consumer_handler_error_then_redelivery_applies_once<DB: ConformanceDb>(
    h: Harness<DB>,
) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let failed = consumer
        .process("evt-1", PAYLOAD, |tx| async move {
            let mut conn = tx.lock().expect("the transaction");
            DB::insert_order(&mut conn, "consumer", 2).await?;
            Err::<(), _>(sqlx::Error::Protocol(
                "the handler failed after a write".into(),
            ))
        })
        .await;
    assert!(
        matches!(failed, Err(ConsumeError::Handler(_))),
        "{failed:?}"
    );
    h.assert_nothing_stored().await;
    let panicked = {
        let consumer = consumer.clone();
        tokio::spawn(async move {
            consumer
                .process("evt-1", PAYLOAD, |tx| async move {
                    let mut conn = tx.lock().expect("the transaction");
                    let id = DB::insert_order(&mut conn, "consumer", 2).await?;
                    if id > 0 {
                        panic!("the handler panicked after a write");
                    }
                    Ok::<_, sqlx::Error>(())
                })
                .await
        })
        .await
    };
    assert!(panicked.is_err(), "the panic reaches the caller");
    h.assert_nothing_stored().await;
    let runs = AtomicUsize::new(0);
    let redelivered = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(
        matches!(redelivered, Ok(Processed::Applied(_))),
        "{redelivered:?}"
    );
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger().await, 1);
}

/// Case: 20 concurrent deliveries of one id apply once.
pub async fn consumer_concurrent_deliveries_apply_once<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock").with_lock_wait(Duration::from_secs(20));
    let runs = Arc::new(AtomicUsize::new(0));
    let mut deliveries = Vec::new();
    for _ in 0..20 {
        let (consumer, runs) = (consumer.clone(), Arc::clone(&runs));
        deliveries.push(tokio::spawn(async move {
            consumer
                .process("evt-1", PAYLOAD, |tx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut conn = tx.lock().expect("the transaction");
                    let id = DB::insert_order(&mut conn, "consumer", 2).await?;
                    drop(conn);
                    // Hold the claim a little, so the others pile up on it.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, sqlx::Error>(id)
                })
                .await
        }));
    }
    let (mut applied, mut duplicates) = (0, 0);
    for d in deliveries {
        match d.await.expect("no panic") {
            Ok(Processed::Applied(_)) => applied += 1,
            Ok(Processed::Duplicate) => duplicates += 1,
            Err(e) => panic!("a delivery failed: {e}"),
        }
    }
    assert_eq!((applied, duplicates), (1, 19));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler never ran twice"
    );
    assert_eq!(h.orders().await, 1);
}

/// Case: the same id with a different payload is reported, never applied;
/// without the payload check it is a plain duplicate.
pub async fn consumer_payload_mismatch_is_reported<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    let first = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(first, Ok(Processed::Applied(_))), "{first:?}");
    let changed = br#"{"orderId":"o-1","sku":"sku-1","qty":3}"#;
    let mismatch = deliver(&consumer, &runs, "evt-1", changed).await;
    match mismatch {
        Err(ConsumeError::PayloadMismatch { message_id }) => assert_eq!(message_id, "evt-1"),
        other => panic!("expected a payload mismatch, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.orders().await, 1);
    let unchecked = Consumer::new(h.pool.clone(), "audit").with_payload_check(false);
    let a = deliver(&unchecked, &runs, "evt-1", PAYLOAD).await;
    let b = deliver(&unchecked, &runs, "evt-1", changed).await;
    assert!(matches!(a, Ok(Processed::Applied(_))), "{a:?}");
    assert!(matches!(b, Ok(Processed::Duplicate)), "{b:?}");
}

/// Case: an id past its retention, tombstoned by the sweeper, is still a
/// duplicate (never applied twice), until its tombstone is purged.
pub async fn consumer_swept_ids_stay_duplicates<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock").with_retention(Duration::from_millis(1));
    let runs = AtomicUsize::new(0);
    let first = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(first, Ok(Processed::Applied(_))), "{first:?}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let swept = Sweeper::new(h.pool.clone()).sweep().await.expect("sweep");
    assert_eq!(h.ledger_with("EXPIRED").await, 1, "{swept:?}");
    let late = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(late, Ok(Processed::Duplicate)), "{late:?}");
    assert_eq!(h.orders().await, 1);
}

/// Case: the consumer as a tower service over messages: the inner service
/// runs once per id, with the claimed transaction.
pub async fn consumer_as_a_tower_service_applies_once<DB: ConformanceDb>(h: Harness<DB>) {
    use tower::ServiceExt;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let inner = tower::service_fn(move |(tx, message): (crate::Tx<DB>, Message)| {
        let counted = Arc::clone(&counted);
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            let mut conn = tx.lock().expect("the transaction");
            let amount = i64::try_from(message.payload.len()).unwrap_or_default();
            DB::insert_order(&mut conn, "service", amount).await
        }
    });
    let service = Consumer::new(h.pool.clone(), "stock").service(inner);
    let message = Message {
        id: "evt-1".into(),
        payload: bytes::Bytes::from_static(PAYLOAD),
    };
    let first = service.clone().oneshot(message.clone()).await;
    assert!(matches!(first, Ok(Processed::Applied(_))), "{first:?}");
    let again = service.clone().oneshot(message).await;
    assert!(matches!(again, Ok(Processed::Duplicate)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.orders().await, 1);
}

/// Case: `with_lock_wait` bounds the wait on a concurrent delivery of the
/// same id on every store (SQLite's busy timeout and MySQL's whole-second
/// lock waits included): `InFlight` in about the wait, not when the first
/// delivery ends.
pub async fn consumer_lock_wait_bounds_a_concurrent_delivery<DB: ConformanceDb>(h: Harness<DB>) {
    let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel::<()>();
    // The first delivery holds its claim until the test lets it go (a far
    // bound, 60 s, only against a stall).
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let consumer = Consumer::new(h.pool.clone(), "stock");
        tokio::spawn(async move {
            consumer
                .process("evt-1", PAYLOAD, |tx| async move {
                    let mut conn = tx.lock().expect("the transaction");
                    DB::insert_order(&mut conn, "consumer", 2).await?;
                    drop(conn);
                    let _ = claimed_tx.send(());
                    let _ = tokio::time::timeout(Duration::from_secs(60), release_rx).await;
                    Ok::<_, sqlx::Error>(())
                })
                .await
        })
    };
    claimed_rx.await.expect("the first delivery claimed the id");
    let second = Consumer::new(h.pool.clone(), "stock").with_lock_wait(Duration::from_millis(200));
    let runs = AtomicUsize::new(0);
    // Judged by order: the second is answered while the first still holds
    // its claim (it is let go only afterwards), within a far bound.
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        deliver(&second, &runs, "evt-1", PAYLOAD),
    )
    .await
    .expect("the second delivery waited for the first to end, not its lock wait");
    assert!(
        matches!(out, Err(ConsumeError::InFlight)),
        "with_lock_wait(200 ms) returned {out:?}"
    );
    assert!(!first.is_finished(), "the first still held its claim");
    let _ = release_tx.send(());
    assert!(matches!(
        first.await.expect("no panic"),
        Ok(Processed::Applied(()))
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // The redelivery after the first committed is a duplicate.
    let later = deliver(&second, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(later, Ok(Processed::Duplicate)), "{later:?}");
    assert_eq!(h.orders().await, 1);
}

/// Case: an id the ledger cannot hold on every store (a NUL, which
/// PostgreSQL's `TEXT` refuses) is refused as [`ConsumeError::InvalidId`]
/// on every store, before anything runs or is stored, and is not a
/// redeliverable error (a redelivery would fail the same way forever).
pub async fn consumer_refuses_ids_the_store_cannot_hold<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    for id in [
        "evt\0-1",
        "\0",
        "evt-1\0",
        &format!("{}\0", "x".repeat(300)),
    ] {
        let out = deliver(&consumer, &runs, id, PAYLOAD).await;
        match out {
            Err(ref e @ ConsumeError::InvalidId) => assert!(!e.redeliver()),
            other => panic!("{}: {id:?} gave {other:?}, not InvalidId", DB::LABEL),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler never ran");
    h.assert_nothing_stored().await;
    // The same id without the NUL is an ordinary id.
    let fine = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(fine, Ok(Processed::Applied(_))), "{fine:?}");
}

/// Case: the longest retention and lock wait a consumer can be given
/// (`Duration::MAX`) still process messages on every store: every duration
/// that becomes SQL arithmetic is capped to what the columns hold.
pub async fn consumer_longest_durations_still_process<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock")
        .with_retention(Duration::MAX)
        .with_lock_wait(Duration::MAX);
    let runs = AtomicUsize::new(0);
    let first = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(
        matches!(first, Ok(Processed::Applied(_))),
        "{}: with_retention(Duration::MAX): {first:?}",
        DB::LABEL
    );
    let again = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(matches!(again, Ok(Processed::Duplicate)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.orders().await, 1);
    // Kept for thousands of years: not expired, and a sweep leaves it.
    assert_eq!(
        DB::count(
            &h.pool,
            "SELECT COUNT(*) FROM idempotency_records WHERE expires_at > 32503680000000"
        )
        .await,
        1,
        "expires after the year 3000"
    );
    let swept = Sweeper::new(h.pool.clone()).sweep().await.expect("sweep");
    assert_eq!(swept.expired, 0);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
}

/// Case: HTTP requests and consumer deliveries never meet in the ledger,
/// whatever the HTTP operation is named: a request of principal `stock`
/// with key `evt-1` never makes consumer `stock`'s `evt-1` a mismatch or a
/// duplicate, and a processed message never answers an HTTP request.
pub async fn consumer_and_http_scopes_never_meet<DB: ConformanceDb>(h: Harness<DB>) {
    use crate::consumer::MESSAGE_OPERATION;
    let message_hash = crate::scope::hashed(MESSAGE_OPERATION).into_owned();
    let names = [
        MESSAGE_OPERATION.to_string(),
        message_hash.clone(),
        crate::scope::hashed(&message_hash).into_owned(),
        "POST /orders".to_string(),
        "/orders".to_string(),
        "Message".to_string(),
        format!("{MESSAGE_OPERATION} "),
    ];
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    let body = r#"{"amount":5}"#;
    // HTTP first, under every name, then the consumer.
    for (i, name) in names.iter().enumerate() {
        let app = h.app_with(h.layer().with_operation(name.as_str()));
        let res = super::send(&app, super::order(Some("stock"), Some("evt-1"), body)).await;
        assert_eq!(res.status, http::StatusCode::CREATED, "{name:?}: {res:?}");
        assert_eq!(h.executions(), i + 1, "{name:?}: the HTTP handler ran");
    }
    let out = deliver(&consumer, &runs, "evt-1", PAYLOAD).await;
    assert!(
        matches!(out, Ok(Processed::Applied(_))),
        "{}: after HTTP requests with key evt-1, the message gave {out:?}",
        DB::LABEL
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the consumer's handler ran once"
    );
    // The consumer first, then HTTP under every name: each runs.
    let out = deliver(&consumer, &runs, "evt-2", PAYLOAD).await;
    assert!(matches!(out, Ok(Processed::Applied(_))), "{out:?}");
    let before = h.executions();
    for (i, name) in names.iter().enumerate() {
        let app = h.app_with(h.layer().with_operation(name.as_str()));
        let res = super::send(&app, super::order(Some("stock"), Some("evt-2"), body)).await;
        assert_eq!(res.status, http::StatusCode::CREATED, "{name:?}: {res:?}");
        assert!(!res.replayed(), "{name:?}: replayed a message's row");
        assert_eq!(
            h.executions(),
            before + i + 1,
            "{name:?}: the HTTP handler ran"
        );
    }
    let again = deliver(&consumer, &runs, "evt-2", PAYLOAD).await;
    assert!(matches!(again, Ok(Processed::Duplicate)), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Case (issue 25): a handler that opens a nested transaction on the
/// claimed one and rolls it back (sqlx's "try this part" idiom) rolls back
/// to a savepoint: the claim survives, the delivery applies once, and
/// redeliveries are duplicates.
pub async fn consumer_nested_rollback_keeps_the_claim<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    for _ in 0..3 {
        let runs = &runs;
        let delivered = consumer
            .process("evt-1", PAYLOAD, |tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut conn = tx.lock().expect("the transaction");
                let id = DB::insert_order(&mut conn, "consumer", 2).await?;
                let mut nested = sqlx::Connection::begin(&mut *conn).await?;
                DB::insert_order(&mut nested, "nested", 1).await?;
                nested.rollback().await?;
                Ok::<_, sqlx::Error>(id)
            })
            .await;
        assert!(
            matches!(delivered, Ok(Processed::Applied(_) | Processed::Duplicate)),
            "{delivered:?}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "applied once in three deliveries"
    );
    assert_eq!(h.orders().await, 1);
    assert_eq!(h.ledger_with("SUCCEEDED").await, 1);
}

/// Case (issue 25 review): a handler that sends its own `COMMIT` keeps what
/// it committed, and the id is held for an operator: redeliveries are
/// refused as unresolved and never apply the message again.
pub async fn consumer_handler_that_commits_itself_is_held<DB: ConformanceDb>(h: Harness<DB>) {
    let consumer = Consumer::new(h.pool.clone(), "stock");
    let runs = AtomicUsize::new(0);
    for delivery in 0..3 {
        let runs = &runs;
        let delivered = consumer
            .process("evt-1", PAYLOAD, |tx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut conn = tx.lock().expect("the transaction");
                let id = DB::insert_order(&mut conn, "consumer", 2).await?;
                DB::exec_on(&mut conn, "COMMIT").await?;
                Ok::<_, sqlx::Error>(id)
            })
            .await;
        assert!(
            matches!(delivered, Err(ConsumeError::Unresolved)),
            "delivery {delivery}: {delivered:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "applied once, then held");
    assert_eq!(h.orders().await, 1);
}
