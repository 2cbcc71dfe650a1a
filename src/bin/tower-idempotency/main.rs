//! `tower-idempotency`: operate the idempotency ledger from a shell.
//!
//! Exit codes: 0 done; 1 refused or not found; 2 bad usage or no
//! database. Errors are one line on standard error.

mod migrate;
mod output;
mod record;
mod resolve;
mod show;
mod status;
mod sweep;
mod unresolved;

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sqlx::Pool;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tower_idempotency::admin::{AdminBackend, Ledger};

use output::{Failure, Outcome, one_line, usage};
use record::ScopeArgs;
use resolve::ResolveArgs;

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
        Command::Migrate => migrate::migrate(&ledger, json).await,
        Command::Status { stranded_after } => {
            let ledger = match stranded_after {
                Some(s) => ledger.with_stranded_after(Duration::from_secs(s)),
                None => ledger,
            };
            status::status(&ledger, json).await
        }
        Command::Unresolved {
            limit,
            stranded_after,
        } => {
            let ledger = match stranded_after {
                Some(s) => ledger.with_stranded_after(Duration::from_secs(s)),
                None => ledger,
            };
            unresolved::unresolved(&ledger, limit, json).await
        }
        Command::Show(scope) => show::show(&ledger, &scope, json).await,
        Command::Resolve(args) => resolve::resolve(&ledger, args, json).await,
        Command::Sweep { dry_run } => sweep::sweep(&ledger, pool, dry_run, json).await,
    }
}
