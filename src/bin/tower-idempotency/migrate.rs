//! `migrate`: apply the ledger's migrations.

use serde_json::json;
use tower_idempotency::admin::{AdminBackend, Ledger};

use crate::output::{Outcome, store};

pub(crate) async fn migrate<DB: AdminBackend>(ledger: &Ledger<DB>, json: bool) -> Outcome {
    let applied = ledger.migrate().await.map_err(store)?;
    for (version, name) in &applied {
        if json {
            println!("{}", json!({"applied": version, "name": name}));
        } else {
            println!("applied {version} {name}");
        }
    }
    if applied.is_empty() && !json {
        println!("the ledger is up to date");
    }
    Ok(())
}
