//! `sweep`: one sweeper pass.

use serde_json::json;
use sqlx::Pool;
use tower_idempotency::Sweeper;
use tower_idempotency::admin::{AdminBackend, Ledger};

use crate::output::{Outcome, store};

pub(crate) async fn sweep<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    pool: Pool<DB>,
    dry_run: bool,
    json: bool,
) -> Outcome {
    if dry_run {
        let p = ledger.sweep_preview().await.map_err(store)?;
        if json {
            println!(
                "{}",
                json!({"dry_run": true, "would_expire": p.expirable, "would_purge": p.purgeable})
            );
        } else {
            println!(
                "would expire {} and purge {} (nothing changed)",
                p.expirable, p.purgeable
            );
        }
        return Ok(());
    }
    let report = Sweeper::new(pool).sweep().await.map_err(store)?;
    if json {
        println!(
            "{}",
            json!({"expired": report.expired, "purged": report.purged, "statements": report.batches})
        );
    } else {
        println!(
            "expired {} and purged {} ({} statements)",
            report.expired, report.purged, report.batches
        );
    }
    Ok(())
}
