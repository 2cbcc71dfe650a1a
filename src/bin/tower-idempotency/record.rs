//! Naming one record from the command line: the scope arguments, the
//! lookup they make, and the one record they name.

use clap::Args;
use serde_json::json;
use tower_idempotency::admin::{AdminBackend, Ledger, LedgerRow, Lookup};

use crate::output::{Failure, shown, store};

#[derive(Debug, Args)]
pub(crate) struct ScopeArgs {
    /// The principal, as sent or as stored.
    #[arg(long)]
    pub(crate) principal: String,
    /// The operation, such as "POST /payments".
    #[arg(long)]
    pub(crate) operation: String,
    /// The key as the client sent it in the header (bare, or the quoted
    /// "…" form), or the stored sha256:… form.
    #[arg(long)]
    pub(crate) key: String,
    /// Take the three values exactly as stored (as `unresolved` prints
    /// them), nothing else: needed when the key as sent and a stored key
    /// of the same text name two records.
    #[arg(long)]
    pub(crate) stored: bool,
}

pub(crate) fn lookup(scope: &ScopeArgs) -> Lookup {
    if scope.stored {
        Lookup::stored(&scope.principal, &scope.operation, &scope.key)
    } else {
        Lookup::new(&scope.principal, &scope.operation, &scope.key)
    }
}

/// The one record `scope` names; when it names two (the key as sent, and
/// another stored with the same text), both are listed and nothing is done.
pub(crate) async fn the_record<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    scope: &ScopeArgs,
    json: bool,
) -> Result<LedgerRow, Failure> {
    let mut found = ledger.find(&lookup(scope)).await.map_err(store)?;
    match found.len() {
        0 => Err(not_found(scope)),
        1 => Ok(found.remove(0)),
        n => {
            if !json {
                for (i, row) in found.iter().enumerate() {
                    println!(
                        "{} {}:",
                        if i == 0 { "as sent" } else { "as stored" },
                        shown(&row.describe())
                    );
                    println!("  principal: {}", shown(&row.principal));
                    println!("  operation: {}", shown(&row.operation));
                    println!("  key:       {}", shown(&row.key));
                }
            }
            Err(Failure::Refused(
                format!(
                    "ambiguous: the key names {n} records, each listed; \
                     name one with --stored and its values as listed"
                ),
                Some(json!({
                    "error": "ambiguous",
                    "records": found.iter().map(LedgerRow::to_json).collect::<Vec<_>>(),
                })),
            ))
        }
    }
}

pub(crate) fn not_found(scope: &ScopeArgs) -> Failure {
    Failure::Refused(
        format!(
            "no record for principal {:?}, operation {:?}, key {:?}",
            scope.principal, scope.operation, scope.key
        ),
        Some(json!({"error": "not_found"})),
    )
}

pub(crate) fn row_scope(row: &LedgerRow) -> tower_idempotency::store::Scope<'_> {
    tower_idempotency::store::Scope {
        principal: &row.principal,
        operation: &row.operation,
        key: &row.key,
    }
}
