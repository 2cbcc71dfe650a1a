//! `status`: rows by status and operation, and what needs an operator.

use tower_idempotency::admin::{AdminBackend, Ledger, human_age};

use crate::output::{Outcome, clip, shown, store};

pub(crate) async fn status<DB: AdminBackend>(ledger: &Ledger<DB>, json: bool) -> Outcome {
    let s = ledger.status().await.map_err(store)?;
    if json {
        println!("{}", s.to_json());
        return Ok(());
    }
    println!("{:<22} {:<40} {:>12}", "STATUS", "OPERATION", "ROWS");
    for c in &s.counts {
        println!(
            "{:<22} {:<40} {:>12}",
            c.status.as_str(),
            clip(&shown(&c.operation), 40),
            c.rows
        );
    }
    println!("rows:                {}", s.total);
    println!("unresolved:          {}", s.unresolved);
    if let Some(age) = s.oldest_unresolved_age_ms() {
        println!("oldest unresolved:   {}", human_age(age));
    }
    println!("parked:              {}", s.parked);
    println!("leased, lease lapsed: {}", s.leased_past_lease);
    match s.oldest_processing_age_ms() {
        Some(age) => println!("oldest PROCESSING:   {} ago", human_age(age)),
        None => println!("oldest PROCESSING:   none"),
    }
    println!("tombstones:          {}", s.tombstones);
    match &s.size {
        Some(size) => println!(
            "size on disk:        {} bytes{} ({})",
            size.bytes,
            if size.estimate { ", estimate" } else { "" },
            size.what
        ),
        None => println!("size on disk:        unknown"),
    }
    let estimates = s.estimates();
    if estimates.is_empty() {
        println!("estimates:           none (every figure is exact)");
    } else {
        println!("estimates:           {}", estimates.join(", "));
    }
    Ok(())
}
