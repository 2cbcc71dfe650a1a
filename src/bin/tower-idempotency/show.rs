//! `show`: one record, its answer and its audit trail.

use serde_json::{Value, json};
use tower_idempotency::admin::{AdminBackend, Ledger, LedgerRow, human_age, step_key};

use crate::output::{Outcome, shown, store, time};
use crate::record::{ScopeArgs, row_scope, the_record};

pub(crate) async fn show<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    scope: &ScopeArgs,
    json: bool,
) -> Outcome {
    let row = the_record(ledger, scope, json).await?;
    let trail = ledger.audit(&row_scope(&row)).await.map_err(store)?;
    if json {
        let mut v = row.to_json();
        if let Value::Object(map) = &mut v {
            map.insert(
                "audit".into(),
                trail.iter().map(|e| e.to_json()).collect::<Vec<_>>().into(),
            );
            map.insert(
                "step_key".into(),
                json!(
                    row.as_unresolved()
                        .as_ref()
                        .and_then(step_key)
                        .map(|k| k.as_str().to_string())
                ),
            );
        }
        println!("{v}");
        return Ok(());
    }
    print_row(&row);
    if trail.is_empty() {
        println!("audit:           none");
    }
    for e in &trail {
        println!(
            "audit #{}:        {} {} by {} ({}): {} [was {}]",
            e.id,
            time(e.recorded_at),
            e.verdict,
            shown(&e.actor),
            e.response_status
                .map_or_else(|| "no answer".to_string(), |s| format!("answer {s}")),
            shown(&e.reason),
            serde_json::from_str::<Value>(&e.before)
                .ok()
                .and_then(|b| b["status"].as_str().map(str::to_string))
                .unwrap_or_default(),
        );
    }
    Ok(())
}

/// What `handler status` is, said beside it.
const HANDLER_STATUS: &str =
    "the handler's, never sent: it ended its transaction itself; the layer answered 500";

/// One record, a field a line; its flags for `resolve` when it is
/// unsettled.
pub(crate) fn print_row(row: &LedgerRow) {
    println!("principal:       {}", shown(&row.principal));
    println!("operation:       {}", shown(&row.operation));
    println!("key:             {}", shown(&row.key));
    println!("status:          {}", row.status.as_str());
    println!(
        "created:         {} ({} ago)",
        time(row.created_at),
        human_age(row.age_ms())
    );
    println!("expires:         {}", time(row.expires_at));
    println!("generation:      {}", row.generation);
    println!("parks:           {}", row.parks);
    println!(
        "claim id:        {}",
        row.claim_id.as_deref().unwrap_or("-")
    );
    if row.generation > 0 {
        println!(
            "pending step:    {}",
            shown(row.pending_step.as_deref().unwrap_or("-"))
        );
        if let Some(key) = row.as_unresolved().as_ref().and_then(step_key) {
            println!("step key:        {}", key.as_str());
        }
        println!(
            "recovery point:  {}",
            shown(row.recovery_point.as_deref().unwrap_or("-"))
        );
        if let Some(t) = row.locked_until {
            println!("locked until:    {}", time(t));
        }
    }
    match (row.response_status, row.is_settled()) {
        // The answer retries replay.
        (Some(status), true) => println!("answer status:   {status}"),
        // What the handler answered when the layer found its transaction
        // ended: never the client's answer.
        (Some(status), false) => println!("handler status:  {status} ({HANDLER_STATUS})"),
        (None, _) => {}
    }
    for (name, value) in row.headers() {
        println!("answer header:   {}: {}", shown(&name), shown(&value));
    }
    match (row.body_text(), &row.response_body) {
        (Some(text), _) => println!("answer body:     {}", shown(text)),
        (None, Some(bytes)) => println!("answer body:     ({} bytes, not text)", bytes.len()),
        (None, None) => {}
    }
    if let Some(id) = &row.resource_id {
        println!("resource id:     {}", shown(id));
    }
    if !row.is_settled() {
        println!(
            "resolve with:    --expect-generation {} --expect-parks {}{}",
            row.generation,
            row.parks,
            row.claim_id
                .as_deref()
                .map_or_else(String::new, |c| format!(" --expect-claim {c}"))
        );
    }
}
