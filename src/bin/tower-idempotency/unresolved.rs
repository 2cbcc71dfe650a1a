//! `unresolved`: every record whose outcome is not settled.

use tower_idempotency::admin::{AdminBackend, Ledger, human_age, step_key, unresolved_json};

use crate::output::{Outcome, clip, shown, store};

pub(crate) async fn unresolved<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    limit: u32,
    json: bool,
) -> Outcome {
    let records = ledger.unresolved(limit).await.map_err(store)?;
    let now = ledger.clock().await.map_err(store)?;
    if json {
        for r in &records {
            println!("{}", unresolved_json(r, now));
        }
        return Ok(());
    }
    if records.is_empty() {
        println!("nothing unresolved");
        return Ok(());
    }
    println!(
        "{:<22} {:>4} {:<12} {:<12} {:>10} {:>7}  STEP KEY",
        "STATUS", "GEN", "PENDING", "RECOVERY", "AGE", "HANDLER"
    );
    for r in &records {
        println!(
            "{:<22} {:>4} {:<12} {:<12} {:>10} {:>7}  {}",
            r.status.as_str(),
            r.generation,
            clip(&shown(r.pending_step.as_deref().unwrap_or("-")), 12),
            clip(&shown(r.recovery_point.as_deref().unwrap_or("-")), 12),
            human_age(now.saturating_sub(r.created_at)),
            r.response_status
                .map_or_else(|| "-".to_string(), |s| s.to_string()),
            step_key(r).map_or_else(|| "-".to_string(), |k| k.as_str().to_string()),
        );
        // The scope whole, each part on its line: what `show` and
        // `resolve` take.
        println!("  principal: {}", shown(&r.principal));
        println!("  operation: {}", shown(&r.operation));
        println!("  key:       {}", shown(&r.key));
    }
    Ok(())
}
