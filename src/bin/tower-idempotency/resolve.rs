//! `resolve`: settle one record, fenced on how it was seen.

use std::path::PathBuf;

use bytes::Bytes;
use clap::{ArgGroup, Args};
use serde_json::{Value, json};
use tower_idempotency::admin::{AdminBackend, Attribution, Ledger, LedgerRow, Seen, settled_by};
use tower_idempotency::{Resolution, ResolveError};

use crate::output::{Failure, Outcome, shown, store, time, usage};
use crate::record::{ScopeArgs, lookup, not_found, row_scope, the_record};

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("verdict").required(true).args(["succeeded", "failed", "rerun"])))]
pub(crate) struct ResolveArgs {
    #[command(flatten)]
    pub(crate) scope: ScopeArgs,
    /// The operation took effect: retries replay --status, --header, --body-file.
    #[arg(long)]
    pub(crate) succeeded: bool,
    /// The operation failed for good: retries replay the answer given.
    #[arg(long)]
    pub(crate) failed: bool,
    /// Nothing took effect: the next retry runs the operation (or its
    /// pending step) again.
    #[arg(long, conflicts_with_all = ["status", "body_file", "headers"])]
    pub(crate) rerun: bool,
    /// The answer's status code (with --succeeded or --failed).
    #[arg(long, value_parser = clap::value_parser!(u16).range(200..=599))]
    pub(crate) status: Option<u16>,
    /// The answer's body, read from this file (at most 1 MiB).
    #[arg(long, value_name = "FILE")]
    pub(crate) body_file: Option<PathBuf>,
    /// An answer header, NAME:VALUE (repeat for more).
    #[arg(long = "header", value_name = "NAME:VALUE")]
    pub(crate) headers: Vec<String>,
    /// Why: recorded in the audit trail.
    #[arg(long)]
    pub(crate) reason: String,
    /// Who: recorded in the audit trail. Defaults to $USER (or $LOGNAME).
    #[arg(long)]
    pub(crate) actor: Option<String>,
    /// The record's generation as `show` printed it (with --expect-parks):
    /// the verdict is refused if the record moved on since. Without it, the
    /// record is taken as it is now; recommended for a lease-mode record.
    #[arg(long, value_name = "N", requires = "expect_parks")]
    pub(crate) expect_generation: Option<i64>,
    /// How often the record had been parked, as `show` printed it.
    #[arg(long, value_name = "P", requires = "expect_generation")]
    pub(crate) expect_parks: Option<i64>,
    /// The record's claim id as `show` printed it (default: the claim id
    /// it has now).
    #[arg(long, value_name = "ID", requires = "expect_generation")]
    pub(crate) expect_claim: Option<String>,
    /// Say what would be done, after the same checks as the verdict
    /// itself; change nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

/// The largest answer body `resolve` reads.
pub(crate) const MAX_BODY: u64 = 1024 * 1024;

pub(crate) async fn resolve<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    args: ResolveArgs,
    json: bool,
) -> Outcome {
    let actor = match &args.actor {
        Some(a) => a.clone(),
        None => std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .map_err(|_| usage("no actor: pass --actor (neither $USER nor $LOGNAME is set)"))?,
    };
    let by = Attribution::new(&actor, &args.reason).map_err(usage)?;
    let resolution = resolution(&args)?;
    let lookup = lookup(&args.scope);
    let verdict = if args.rerun {
        "rerun".to_string()
    } else {
        format!(
            "{} {}",
            if args.succeeded {
                "succeeded"
            } else {
                "failed"
            },
            args.status.unwrap_or_default()
        )
    };
    let row = the_record(ledger, &args.scope, json).await?;
    if row.is_settled() {
        return Err(settled(ledger, &row).await);
    }
    let seen = match (args.expect_generation, args.expect_parks) {
        (Some(generation), Some(parks)) => Seen::new(
            generation,
            parks,
            args.expect_claim.clone().or_else(|| row.claim_id.clone()),
        ),
        // The interface: the record as it is now.
        _ => Seen::of(&row),
    };
    if args.dry_run {
        if let Err(e) = row.admits(&seen) {
            return Err(moved(ledger, &args.scope, &seen, e, Some(row)).await);
        }
        if json {
            println!(
                "{}",
                json!({"dry_run": true, "would": verdict, "actor": by.actor(), "record": row.to_json()})
            );
        } else {
            println!(
                "would record {verdict} on {} / {} / {} ({}), as {}",
                shown(&row.principal),
                shown(&row.operation),
                shown(&row.key),
                shown(&row.describe()),
                shown(by.actor())
            );
        }
        return Ok(());
    }
    match ledger.resolve_seen(&lookup, &seen, resolution, &by).await {
        Ok(done) => {
            let after = done.after.as_ref();
            if json {
                println!(
                    "{}",
                    json!({
                        "resolved": verdict,
                        "actor": by.actor(),
                        "reason": by.reason(),
                        "before": done.before.to_json(),
                        "after": after.map(LedgerRow::to_json),
                    })
                );
            } else {
                println!(
                    "resolved {} / {} / {}: {} (generation {}) -> {}, by {}",
                    shown(&done.before.principal),
                    shown(&done.before.operation),
                    shown(&done.before.key),
                    done.before.status.as_str(),
                    done.before.generation,
                    after.map_or_else(
                        || "deleted: the next request runs afresh".to_string(),
                        |a| match a.response_status {
                            Some(s) => format!("{} {s}", a.status.as_str()),
                            None => format!(
                                "{} (generation {}, lease ended: the next retry resumes)",
                                a.status.as_str(),
                                a.generation
                            ),
                        }
                    ),
                    shown(by.actor())
                );
            }
            Ok(())
        }
        Err(ResolveError::Store(e)) => Err(store(e)),
        Err(e) => Err(moved(ledger, &args.scope, &seen, e, None).await),
    }
}

/// The refusal of a verdict on a record that is not as seen: what it is
/// now (read again unless given).
pub(crate) async fn moved<DB: AdminBackend>(
    ledger: &Ledger<DB>,
    scope: &ScopeArgs,
    seen: &Seen,
    e: ResolveError,
    row: Option<LedgerRow>,
) -> Failure {
    let row = match row {
        Some(row) => Some(row),
        None => match ledger.show(&lookup(scope)).await {
            Ok(row) => row,
            Err(e) => return store(e),
        },
    };
    let Some(row) = row else {
        return not_found(scope);
    };
    if row.is_settled() {
        return settled(ledger, &row).await;
    }
    let why = match &e {
        ResolveError::Held { .. } => e.to_string(),
        ResolveError::Gone => "the key was claimed afresh since it was seen".to_string(),
        _ => format!(
            "the record moved since it was seen (generation {}, parks {})",
            seen.generation, seen.parks
        ),
    };
    Failure::Refused(
        format!(
            "refused: {why}; it is {} now: show it again and decide on what it is now",
            shown(&row.describe())
        ),
        Some(json!({
            "refused": refusal_kind(&e),
            "message": e.to_string(),
            "record": row.to_json(),
        })),
    )
}

pub(crate) fn refusal_kind(e: &ResolveError) -> &'static str {
    match e {
        ResolveError::Settled { .. } => "settled",
        ResolveError::Gone => "gone",
        ResolveError::Held { .. } => "held",
        ResolveError::Changed { .. } => "changed",
        ResolveError::Ambiguous { .. } => "ambiguous",
        _ => "error",
    }
}

/// The refusal of a verdict on a settled record: what it is now and who
/// settled it (the operator whose verdict it carries, or the service).
pub(crate) async fn settled<DB: AdminBackend>(ledger: &Ledger<DB>, row: &LedgerRow) -> Failure {
    let trail = ledger.audit(&row_scope(row)).await.unwrap_or_default();
    let last = settled_by(row, &trail);
    let now = match row.response_status {
        Some(s) => format!("{} {s}", row.status.as_str()),
        None => row.status.as_str().to_string(),
    };
    let (who, by) = match &last {
        Some(e) => (
            format!(
                "{} at {} ({})",
                shown(&e.actor),
                time(e.recorded_at),
                shown(&e.reason)
            ),
            json!(e.actor),
        ),
        None => (
            "the service (a retry or the completer)".to_string(),
            Value::Null,
        ),
    };
    Failure::Refused(
        format!("refused: the record was settled first by {who}; it is {now} now"),
        Some(json!({"refused": "settled", "settled_by": by, "record": row.to_json()})),
    )
}

pub(crate) fn resolution(args: &ResolveArgs) -> Result<Resolution, Failure> {
    if args.rerun {
        return Ok(Resolution::Rerun);
    }
    let Some(status) = args.status else {
        return Err(usage("--succeeded and --failed need --status"));
    };
    let body = match &args.body_file {
        Some(path) => {
            let len = std::fs::metadata(path)
                .map_err(|e| usage(format!("{}: {e}", path.display())))?
                .len();
            if len > MAX_BODY {
                return Err(usage(format!(
                    "{}: {len} bytes, over the {MAX_BODY}-byte limit",
                    path.display()
                )));
            }
            Bytes::from(std::fs::read(path).map_err(|e| usage(format!("{}: {e}", path.display())))?)
        }
        None => Bytes::new(),
    };
    let mut res = http::Response::builder().status(status);
    for h in &args.headers {
        let Some((name, value)) = h.split_once(':') else {
            return Err(usage(format!("--header {h:?}: expected NAME:VALUE")));
        };
        res = res.header(name.trim(), value.trim());
    }
    let res = res
        .body(body)
        .map_err(|e| usage(format!("the answer: {e}")))?;
    Ok(if args.succeeded {
        Resolution::Succeeded(res)
    } else {
        Resolution::Failed(res)
    })
}
