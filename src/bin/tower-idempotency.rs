//! `tower-idempotency`: operate the idempotency ledger from a shell.
//!
//! Exit codes: 0 done; 1 refused or not found; 2 bad usage or no
//! database. Errors are one line on standard error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use bytes::Bytes;
use clap::{ArgGroup, Args, Parser, Subcommand};
use serde_json::{Value, json};
use sqlx::Pool;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tower_idempotency::admin::{
    AdminBackend, Attribution, Ledger, LedgerRow, Lookup, Seen, human_age, settled_by, step_key,
    unresolved_json,
};
use tower_idempotency::{Resolution, ResolveError, Sweeper};

/// Operate the tower-idempotency ledger: list what is unsettled, look at a
/// record, settle it with an audit trail, sweep.
#[derive(Debug, Parser)]
#[command(name = "tower-idempotency", version)]
struct Cli {
    /// The ledger's database: postgres://…, mysql://… (mariadb://…) or
    /// sqlite://…
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Print JSON lines (one object per line) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the ledger's migrations, printing each version applied.
    Migrate,
    /// Rows by status and operation, the oldest PROCESSING row, parked and
    /// stranded rows, tombstones, size on disk.
    Status {
        /// Count lapsed leases with nothing pending as unresolved after
        /// this many seconds (as `unresolved --stranded-after`).
        #[arg(long, value_name = "SECONDS")]
        stranded_after: Option<u64>,
    },
    /// Every record whose outcome is not settled, oldest first.
    Unresolved {
        /// The most records to list (1 to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// List lapsed leases with nothing pending after this many seconds.
        #[arg(long, value_name = "SECONDS")]
        stranded_after: Option<u64>,
    },
    /// One record, with its recorded answer and its audit trail.
    Show(ScopeArgs),
    /// Settle one record as you saw it: --succeeded or --failed with the
    /// answer retries will replay, or --rerun; --reason is required. Name
    /// the record as `show` printed it (--expect-generation N
    /// --expect-parks P) and the verdict is refused (exit 1) if it moved
    /// on since (rerun by someone else, taken over, parked again); without
    /// them it applies to the record as it is now.
    Resolve(ResolveArgs),
    /// One sweeper pass: expire terminal rows past retention, purge old
    /// tombstones.
    Sweep {
        /// Count what the pass would do; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Debug, Args)]
struct ScopeArgs {
    /// The principal, as sent or as stored.
    #[arg(long)]
    principal: String,
    /// The operation, such as "POST /payments".
    #[arg(long)]
    operation: String,
    /// The key, as the client sent it (bare, or the header's quoted
    /// "…" form), or the stored sha256:… form.
    #[arg(long)]
    key: String,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("verdict").required(true).args(["succeeded", "failed", "rerun"])))]
struct ResolveArgs {
    #[command(flatten)]
    scope: ScopeArgs,
    /// The operation took effect: retries replay --status, --header, --body-file.
    #[arg(long)]
    succeeded: bool,
    /// The operation failed for good: retries replay the answer given.
    #[arg(long)]
    failed: bool,
    /// Nothing took effect: the next retry runs the operation (or its
    /// pending step) again.
    #[arg(long, conflicts_with_all = ["status", "body_file", "headers"])]
    rerun: bool,
    /// The answer's status code (with --succeeded or --failed).
    #[arg(long, value_parser = clap::value_parser!(u16).range(200..=599))]
    status: Option<u16>,
    /// The answer's body, read from this file (at most 1 MiB).
    #[arg(long, value_name = "FILE")]
    body_file: Option<PathBuf>,
    /// An answer header, NAME:VALUE (repeat for more).
    #[arg(long = "header", value_name = "NAME:VALUE")]
    headers: Vec<String>,
    /// Why: recorded in the audit trail.
    #[arg(long)]
    reason: String,
    /// Who: recorded in the audit trail. Defaults to $USER (or $LOGNAME).
    #[arg(long)]
    actor: Option<String>,
    /// The record's generation as `show` printed it (with --expect-parks):
    /// the verdict is refused if the record moved on since. Without it, the
    /// record is taken as it is now; recommended for a lease-mode record.
    #[arg(long, value_name = "N", requires = "expect_parks")]
    expect_generation: Option<i64>,
    /// How often the record had been parked, as `show` printed it.
    #[arg(long, value_name = "P", requires = "expect_generation")]
    expect_parks: Option<i64>,
    /// The record's claim id as `show` printed it (default: the claim id
    /// it has now).
    #[arg(long, value_name = "ID", requires = "expect_generation")]
    expect_claim: Option<String>,
    /// Say what would be done, after the same checks as the verdict
    /// itself; change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// The largest answer body `resolve` reads.
const MAX_BODY: u64 = 1024 * 1024;

/// How a command ended.
#[derive(Debug)]
enum Failure {
    /// Refused, or not found: exit 1.
    Refused(String, Option<Value>),
    /// Bad usage, or no database: exit 2.
    Usage(String),
}

type Outcome = Result<(), Failure>;

fn usage(msg: impl std::fmt::Display) -> Failure {
    Failure::Usage(msg.to_string())
}

fn store(e: sqlx::Error) -> Failure {
    Failure::Usage(format!("database: {e}"))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(2);
            }
            eprintln!("{}", one_line(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tower-idempotency: cannot start: {e}");
            return ExitCode::from(2);
        }
    };
    let json = cli.json;
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused(msg, detail)) => {
            if let (true, Some(detail)) = (json, detail) {
                println!("{detail}");
            }
            eprintln!("tower-idempotency: {}", one_line(&msg));
            ExitCode::from(1)
        }
        Err(Failure::Usage(msg)) => {
            eprintln!("tower-idempotency: {}", one_line(&msg));
            ExitCode::from(2)
        }
    }
}

/// A message as one line: clap's usage block and tips dropped, line breaks
/// folded.
fn one_line(msg: &str) -> String {
    msg.lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

async fn dispatch(cli: Cli) -> Outcome {
    let Some(url) = cli.database_url.clone() else {
        return Err(usage(
            "no database: pass --database-url or set DATABASE_URL",
        ));
    };
    let scheme = url.split(':').next().unwrap_or_default();
    let wait = Duration::from_secs(10);
    let unreachable = |e: sqlx::Error| usage(format!("no database at the URL given: {e}"));
    match scheme {
        "postgres" | "postgresql" => {
            let options = PgConnectOptions::from_str(&url)
                .map_err(|e| usage(format!("bad database URL: {e}")))?;
            probe::<sqlx::PgConnection>(&options, wait).await?;
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(wait)
                .connect_with(options)
                .await
                .map_err(unreachable)?;
            run(pool, cli).await
        }
        "mysql" | "mariadb" => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let options = MySqlConnectOptions::from_str(&url)
                .map_err(|e| usage(format!("bad database URL: {e}")))?;
            probe::<sqlx::MySqlConnection>(&options, wait).await?;
            let pool = MySqlPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(wait)
                .connect_with(options)
                .await
                .map_err(unreachable)?;
            run(pool, cli).await
        }
        "sqlite" => {
            // Only `migrate` creates a missing database file: anything else
            // on a mistyped path would show an empty ledger.
            let options = SqliteConnectOptions::from_str(&url)
                .map_err(|e| usage(format!("bad database URL: {e}")))?
                .create_if_missing(matches!(cli.command, Command::Migrate))
                .busy_timeout(Duration::from_secs(5));
            let pool = SqlitePoolOptions::new()
                .max_connections(2)
                .acquire_timeout(wait)
                .connect_with(options)
                .await
                .map_err(unreachable)?;
            run(pool, cli).await
        }
        _ => Err(usage(format!(
            "unsupported database URL scheme {scheme:?}: use postgres://, mysql:// or sqlite://"
        ))),
    }
}

/// One connection first, so that a server nobody listens on (refused, an
/// unknown host) is said at once and in its own words, not as a pool that
/// timed out retrying.
async fn probe<C: sqlx::Connection>(options: &C::Options, wait: Duration) -> Outcome {
    match tokio::time::timeout(wait, C::connect_with(options)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(usage(format!("no database at the URL given: {e}"))),
        Err(_) => Err(usage(format!(
            "no database at the URL given: no answer within {} s",
            wait.as_secs()
        ))),
    }
}

async fn run<DB: AdminBackend>(pool: Pool<DB>, cli: Cli) -> Outcome {
    let ledger = Ledger::new(pool.clone());
    let json = cli.json;
    match cli.command {
        Command::Migrate => migrate(&ledger, json).await,
        Command::Status { stranded_after } => {
            let ledger = match stranded_after {
                Some(s) => ledger.with_stranded_after(Duration::from_secs(s)),
                None => ledger,
            };
            status(&ledger, json).await
        }
        Command::Unresolved {
            limit,
            stranded_after,
        } => {
            let ledger = match stranded_after {
                Some(s) => ledger.with_stranded_after(Duration::from_secs(s)),
                None => ledger,
            };
            unresolved(&ledger, limit, json).await
        }
        Command::Show(scope) => show(&ledger, &scope, json).await,
        Command::Resolve(args) => resolve(&ledger, args, json).await,
        Command::Sweep { dry_run } => sweep(&ledger, pool, dry_run, json).await,
    }
}

async fn migrate<DB: AdminBackend>(ledger: &Ledger<DB>, json: bool) -> Outcome {
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

async fn status<DB: AdminBackend>(ledger: &Ledger<DB>, json: bool) -> Outcome {
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

async fn unresolved<DB: AdminBackend>(ledger: &Ledger<DB>, limit: u32, json: bool) -> Outcome {
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
        "{:<22} {:>4} {:<12} {:<12} {:>10} {:>5}  STEP KEY",
        "STATUS", "GEN", "PENDING", "RECOVERY", "AGE", "LAST"
    );
    for r in &records {
        println!(
            "{:<22} {:>4} {:<12} {:<12} {:>10} {:>5}  {}",
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

fn lookup(scope: &ScopeArgs) -> Lookup {
    Lookup::new(&scope.principal, &scope.operation, &scope.key)
}

fn not_found(scope: &ScopeArgs) -> Failure {
    Failure::Refused(
        format!(
            "no record for principal {:?}, operation {:?}, key {:?}",
            scope.principal, scope.operation, scope.key
        ),
        Some(json!({"error": "not_found"})),
    )
}

async fn show<DB: AdminBackend>(ledger: &Ledger<DB>, scope: &ScopeArgs, json: bool) -> Outcome {
    let Some(row) = ledger.show(&lookup(scope)).await.map_err(store)? else {
        return Err(not_found(scope));
    };
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

fn row_scope(row: &LedgerRow) -> tower_idempotency::store::Scope<'_> {
    tower_idempotency::store::Scope {
        principal: &row.principal,
        operation: &row.operation,
        key: &row.key,
    }
}

fn print_row(row: &LedgerRow) {
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
    if let Some(status) = row.response_status {
        println!("answer status:   {status}");
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
    if row.generation > 0 && !row.is_settled() {
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

async fn resolve<DB: AdminBackend>(ledger: &Ledger<DB>, args: ResolveArgs, json: bool) -> Outcome {
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
    let Some(row) = ledger.show(&lookup).await.map_err(store)? else {
        return Err(not_found(&args.scope));
    };
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
async fn moved<DB: AdminBackend>(
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

fn refusal_kind(e: &ResolveError) -> &'static str {
    match e {
        ResolveError::Settled { .. } => "settled",
        ResolveError::Gone => "gone",
        ResolveError::Held { .. } => "held",
        ResolveError::Changed { .. } => "changed",
        _ => "error",
    }
}

/// The refusal of a verdict on a settled record: what it is now and who
/// settled it (the operator whose verdict it carries, or the service).
async fn settled<DB: AdminBackend>(ledger: &Ledger<DB>, row: &LedgerRow) -> Failure {
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

fn resolution(args: &ResolveArgs) -> Result<Resolution, Failure> {
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

async fn sweep<DB: AdminBackend>(
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

/// Stored text as a terminal may show it: control characters (a terminal
/// escape sequence, a newline) written as `\x1b` or `\u{…}`, and a
/// backslash as `\\`, so nothing stored reaches the terminal raw and the
/// spelling is never ambiguous.
fn shown(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c.is_control() && (c as u32) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Epoch milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
fn time(ms: i64) -> String {
    let (secs, millis) = (ms.div_euclid(1000), ms.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn stored_text_is_shown_escaped() {
        assert_eq!(super::shown("a\u{1b}[31mb"), "a\\x1b[31mb");
        assert_eq!(super::shown("a\\x1b"), "a\\\\x1b");
        assert_eq!(super::shown("line\nnext\u{85}"), "line\\x0anext\\u{85}");
        assert_eq!(super::shown("plain ü"), "plain ü");
    }

    #[test]
    fn times_are_utc_iso_8601() {
        assert_eq!(super::time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::time(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(super::time(1_796_188_611_281), "2026-12-02T05:16:51.281Z");
        assert_eq!(super::time(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn clap_errors_become_one_line() {
        let e = "error: the following required arguments were not provided:\n  --reason <REASON>\n\nUsage: tower-idempotency resolve --reason <REASON>\n\nFor more information, try '--help'.\n";
        assert_eq!(
            super::one_line(e),
            "error: the following required arguments were not provided: --reason <REASON>"
        );
    }
}
