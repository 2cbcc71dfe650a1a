//! The README's start ("Your own app"): its Rust block is
//! `examples/start.rs` character for character, its `Cargo.toml` lines
//! name every crate that file uses with the versions this crate builds it
//! with, and the example, run as a process on a fresh PostgreSQL database,
//! does what the README says, judged by the rows committed.

mod common;
#[path = "common/http.rs"]
mod http_call;

use http::{Method, StatusCode};
use http_call::http_call;
use tower_idempotency::testkit::ConformanceDb;

const README: &str = include_str!("../README.md");
const EXAMPLE: &str = include_str!("../examples/start.rs");
const MANIFEST: &str = include_str!("../Cargo.toml");

/// The fenced block of `lang` that follows the README's "Your own app"
/// heading.
fn start_block(lang: &str) -> String {
    let section = README
        .split("\n## Your own app\n")
        .nth(1)
        .expect("the README has a \"## Your own app\" section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let fence = format!("```{lang}\n");
    let start = section
        .find(&fence)
        .unwrap_or_else(|| panic!("a ```{lang} block in \"Your own app\""))
        + fence.len();
    let len = section[start..].find("```\n").expect("the block ends");
    section[start..start + len].to_string()
}

#[test]
fn the_readmes_start_is_the_example_verbatim() {
    let shown = start_block("rust");
    if shown != EXAMPLE {
        let line = shown
            .lines()
            .zip(EXAMPLE.lines())
            .position(|(a, b)| a != b)
            .map_or("the end".to_string(), |i| format!("line {}", i + 1));
        panic!("the README's start differs from examples/start.rs at {line}");
    }
}

/// The version requirement of `name` in a TOML text's dependency line
/// (`name = "1"` or `name = { version = "1", … }`).
fn requirement(toml: &str, name: &str) -> Option<String> {
    let mut section = "";
    toml.lines()
        .map(str::trim)
        .filter(|line| {
            if line.starts_with('[') {
                section = line;
            }
            name == "version" || section.contains("dependencies")
        })
        .find_map(|line| line.strip_prefix(&format!("{name} = ")))
        .map(|rest| {
            let rest = rest.split("version = ").nth(1).unwrap_or(rest);
            rest.trim_start_matches('{')
                .trim()
                .trim_start_matches('"')
                .split('"')
                .next()
                .unwrap_or_default()
                .to_string()
        })
}

#[test]
fn the_readmes_cargo_lines_name_what_the_start_uses() {
    let lines = start_block("toml");
    // Every crate the start uses, with the requirement this crate's own
    // manifest builds the example with (a dev-dependency, or this crate).
    let used = [
        "tower-idempotency",
        "axum",
        "sqlx",
        "tokio",
        "serde",
        "tracing-subscriber",
    ];
    for name in used {
        let shown = requirement(&lines, name)
            .unwrap_or_else(|| panic!("the README's Cargo.toml lines name {name}"));
        let ours = if name == "tower-idempotency" {
            // `0.1.0` is matched by `0.1`.
            let version = requirement(MANIFEST, "version").expect("the package version");
            assert!(version.starts_with(&shown), "{name}: {shown} vs {version}");
            continue;
        } else {
            requirement(MANIFEST, name).unwrap_or_else(|| panic!("Cargo.toml names {name}"))
        };
        assert_eq!(
            shown, ours,
            "{name}: the README asks for {shown}, the crate builds with {ours}"
        );
        let crate_name = name.replace('-', "_");
        assert!(
            EXAMPLE.contains(&format!("{crate_name}::")),
            "examples/start.rs uses {name}"
        );
    }
    // The features the start needs.
    assert!(lines.contains("\"postgres\""), "{lines}");
    assert!(lines.contains("\"derive\""), "{lines}");
    assert!(lines.contains("\"macros\""), "{lines}");
}

/// The start as a process: a payment, its retry (the same answer, one
/// row), the same key with another amount (refused, no row), a refused
/// amount (nothing stored, the key usable afterwards), no key, and no
/// principal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_runs_as_the_readme_says() {
    let (url, _drop) = <sqlx::Postgres as ConformanceDb>::fresh_url().await;
    let (_child, addr) = common::start_example(
        "start",
        &[],
        &[("DATABASE_URL", &url), ("ADDR", "127.0.0.1:0")],
    )
    .await;
    let pay = |key: Option<&'static str>, body: &'static str| {
        let addr = addr.clone();
        async move { http_call(&addr, Method::POST, "/payments", Some("alice"), key, body).await }
    };
    let first = pay(Some("\"pay-1\""), r#"{"amount":1200,"currency":"EUR"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.json()["amount"], 1200, "{first:?}");
    let retry = pay(Some("\"pay-1\""), r#"{"amount":1200,"currency":"EUR"}"#).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed(), "{retry:?}");
    let reused = pay(Some("\"pay-1\""), r#"{"amount":9900,"currency":"EUR"}"#).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{reused:?}"
    );
    assert!(reused.problem_type().ends_with("#key-reused"), "{reused:?}");
    let refused = pay(Some("\"pay-2\""), r#"{"amount":0,"currency":"EUR"}"#).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{refused:?}"
    );
    let fixed = pay(Some("\"pay-2\""), r#"{"amount":50,"currency":"EUR"}"#).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{fixed:?}");
    let no_key = pay(None, r#"{"amount":70,"currency":"EUR"}"#).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{no_key:?}");
    let anonymous = http_call(
        &addr,
        Method::POST,
        "/payments",
        None,
        Some("\"pay-3\""),
        r#"{"amount":70,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED, "{anonymous:?}");
    // Judged by the rows: one payment per key that succeeded, one ledger
    // row for each of them, nothing for the refusals.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let payments: Vec<(String, i64)> =
        sqlx::query_as("SELECT payer, amount FROM payments ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        payments,
        vec![("alice".to_string(), 1200), ("alice".to_string(), 50)]
    );
    let ledger: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_records")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ledger, 2);
}
