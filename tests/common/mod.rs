//! What the end-to-end tests that run example processes share.

// Each test crate that includes this module uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `#[tokio::test]`s named `postgres::case`, `sqlite::case` and (with the
/// `mysql` feature) `mysql::case` for each generic `case::<DB>()` (the
/// crate includes this module with `#[macro_use]`).
#[allow(unused_macros)]
macro_rules! on_every_store {
    ($($case:ident),+ $(,)?) => {
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $case() { super::$case::<sqlx::Postgres>().await })+
        }
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $case() { super::$case::<sqlx::Sqlite>().await })+
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $case() { super::$case::<sqlx::MySql>().await })+
        }
    };
}

/// The operators' tests: a fresh ledger with a parked payment.
#[cfg(all(feature = "testkit", feature = "postgres", feature = "sqlite"))]
pub mod ledger;

/// The example binary `name` that `cargo test` builds next to this test,
/// refused when missing or older than its source.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let bin = target.join("examples").join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified());
    let Ok(built) = modified(&bin) else {
        panic!(
            "{} is missing: run through cargo test, or cargo build --example {name} first",
            bin.display()
        );
    };
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(format!("{name}.rs"));
    if let Ok(written) = modified(&source) {
        assert!(
            written <= built,
            "{} is older than its source: cargo build --example {name}",
            bin.display()
        );
    }
    bin
}

/// The `HOST:PORT` of a start-up line `… listening on http://HOST:PORT …`.
pub fn address(line: &str) -> String {
    line.split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected start-up line {line:?}"))
        .to_string()
}

/// Starts the example order service on `url` (`--addr 127.0.0.1:0`, the
/// handler delay), with `env` added; the process (killed when dropped) and
/// its `HOST:PORT`.
pub async fn order_service(
    url: &str,
    delay_ms: u64,
    env: &[(&str, &str)],
) -> (tokio::process::Child, String) {
    let env: Vec<_> = [("DATABASE_URL", url)]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    let delay = delay_ms.to_string();
    start_example(
        "order_service",
        &["--addr", "127.0.0.1:0", "--handler-delay-ms", &delay],
        &env,
    )
    .await
}

/// Starts example `name` with `args` and `env`, and reads its address
/// from the first line that names one (within 30 s); stdout is drained afterwards, so the
/// process never blocks on a full pipe. The process is killed when
/// dropped.
pub async fn start_example(
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(example(name))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    // The first line that names an address (log lines may come first).
    let first_address = async {
        loop {
            match lines.next_line().await.unwrap() {
                Some(line) if line.contains("http://") => break line,
                Some(_) => continue,
                None => panic!("{name} printed no start-up line"),
            }
        }
    };
    let line = tokio::time::timeout(std::time::Duration::from_secs(30), first_address)
        .await
        .unwrap_or_else(|_| panic!("{name} starts within 30 s"));
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, address(&line))
}
