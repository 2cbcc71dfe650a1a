//! A fresh ledger with a parked payment, for the operators' tests: the
//! testkit's payment app in lease mode, its charge's answer lost and the
//! provider's look-up down, so the record is parked as
//! `NEEDS_RECONCILIATION` with its `charge` step pending.

use std::time::Duration;

use http::StatusCode;
use sqlx::Pool;
use tower_idempotency::admin::AdminBackend;
use tower_idempotency::lease::LeaseMode;
use tower_idempotency::testkit::lease::{Fault, PayApp, payment};
use tower_idempotency::testkit::{ConformanceDb, Harness, send};

/// The body every payment sends.
pub const PAY: &str = r#"{"amount":5000}"#;
/// The principal of `payment()`.
pub const PAYER: &str = "payer-1";
/// The operation of the payment app.
pub const OPERATION: &str = "POST /payments";

/// A store the operators' tools run on, and the URL of a test database.
pub trait Store: ConformanceDb + AdminBackend {
    /// The URL the pool connected to (for a process such as the CLI).
    fn url_of(pool: &Pool<Self>) -> String;
}

fn server_url(admin: &str, db: &str) -> String {
    let (base, query) = match admin.find('?') {
        Some(q) => admin.split_at(q),
        None => (admin, ""),
    };
    let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
    format!("{base}/{db}{query}")
}

impl Store for sqlx::Postgres {
    fn url_of(pool: &Pool<Self>) -> String {
        let db = pool
            .connect_options()
            .get_database()
            .unwrap_or("postgres")
            .to_string();
        server_url(&tower_idempotency::testkit::pg_admin_url(), &db)
    }
}

impl Store for sqlx::Sqlite {
    fn url_of(pool: &Pool<Self>) -> String {
        format!(
            "sqlite://{}",
            pool.connect_options().get_filename().display()
        )
    }
}

#[cfg(feature = "mysql")]
impl Store for sqlx::MySql {
    fn url_of(pool: &Pool<Self>) -> String {
        let db = pool
            .connect_options()
            .get_database()
            .unwrap_or("test")
            .to_string();
        server_url(&tower_idempotency::testkit::mysql_admin_url(), &db)
    }
}

/// A payment app on a fresh database (leases of 30 s).
pub async fn pay_app<DB: Store>() -> (Harness<DB>, PayApp<DB>) {
    let h = Harness::<DB>::new().await;
    let mode = LeaseMode::new(Duration::from_secs(30)).expect("a usable lease");
    let app = h.pay_app(mode, Duration::from_secs(2)).await;
    (h, app)
}

/// Parks payment `key`: the charge is made, its answer lost, the look-up
/// down (and left down).
pub async fn park<DB: Store>(app: &PayApp<DB>, key: &str) {
    app.state.provider.fault(Fault::ChargeThenDrop);
    app.state.provider.lookup_down(true);
    let a = send(&app.router, payment(key, PAY)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    assert_eq!(a.problem(), "reconciling", "{a:?}");
}

/// Pays `key` to the end (no fault).
pub async fn pay<DB: Store>(app: &PayApp<DB>, key: &str) {
    app.state.provider.clear_faults();
    let a = send(&app.router, payment(key, PAY)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
}
