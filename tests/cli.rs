//! The `tower-idempotency` binary, run as a process against a fresh
//! database on every store: list, show, resolve (and each refusal), sweep,
//! migrate, status; exit codes; JSON lines that parse.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::ledger::{OPERATION, PAY, PAYER, Store, park, pay, pay_app};
use serde_json::Value;
use tower_idempotency::testkit::lease::{Fault, payment};
use tower_idempotency::testkit::send;

on_every_store!(
    unresolved_and_show_print_scopes_whole_and_escaped,
    list_show_resolve_and_the_retry_replays,
    refusals_exit_1_with_one_line,
    a_held_record_is_refused,
    sweep_status_and_migrate,
    a_default_mode_record_is_rerun_by_deleting_it,
    a_verdict_on_a_record_that_moved_since_show_is_refused,
    a_quoted_key_is_read_as_sent_and_an_ambiguous_one_is_never_resolved,
    a_record_whose_handler_committed_reads_alike_in_status_show_and_unresolved,
);

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Every stdout line, parsed (each must be one JSON value).
    fn json_lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect()
    }

    fn one_json(&self) -> Value {
        let mut lines = self.json_lines();
        assert_eq!(lines.len(), 1, "{self:?}");
        lines.remove(0)
    }

    /// Exit 1 or 2: one line on stderr, no panic, no backtrace.
    fn assert_failed(&self, code: i32, says: &str) {
        assert_eq!(self.code, code, "{self:?}");
        assert_eq!(self.stderr.lines().count(), 1, "one line: {self:?}");
        assert!(self.stderr.contains(says), "{says:?} in {self:?}");
        assert!(!self.stderr.contains("panicked"), "{self:?}");
        assert!(
            !self.stderr.to_lowercase().contains("backtrace"),
            "{self:?}"
        );
    }
}

/// Runs the binary with `args`; `DATABASE_URL` = `url` unless empty,
/// `USER` = `user`.
async fn cli_as(url: &str, user: &str, args: &[&str]) -> Out {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_tower-idempotency"));
    cmd.args(args).env_clear().env("USER", user);
    if !url.is_empty() {
        cmd.env("DATABASE_URL", url);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the CLI ends within 60 s")
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

async fn cli(url: &str, args: &[&str]) -> Out {
    cli_as(url, "carol", args).await
}

fn scope(key: &str) -> Vec<&str> {
    vec!["--principal", PAYER, "--operation", OPERATION, "--key", key]
}

async fn list_show_resolve_and_the_retry_replays<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    let url = DB::url_of(&h.pool);
    park(&app, "pay-1").await;
    pay(&app, "pay-2").await;

    let listed = cli(&url, &["unresolved", "--json"]).await;
    assert_eq!(listed.code, 0, "{listed:?}");
    let record = listed.one_json();
    assert_eq!(record["key"], "pay-1", "{record}");
    assert_eq!(record["status"], "NEEDS_RECONCILIATION");
    assert_eq!(record["pending_step"], "charge");
    assert!(
        record["step_key"].as_str().is_some_and(|k| !k.is_empty()),
        "{record}"
    );
    assert!(
        record["age_ms"].as_i64().is_some_and(|a| a >= 0),
        "{record}"
    );
    let table = cli(&url, &["unresolved"]).await;
    assert_eq!(table.code, 0, "{table:?}");
    assert!(table.stdout.contains("NEEDS_RECONCILIATION"), "{table:?}");
    assert!(table.stdout.contains("charge"), "{table:?}");
    assert!(table.stdout.contains(record["step_key"].as_str().unwrap()));

    let mut show = vec!["show", "--json"];
    show.extend(scope("pay-1"));
    let shown = cli(&url, &show).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    let row = shown.one_json();
    assert_eq!(row["status"], "NEEDS_RECONCILIATION", "{row}");
    assert_eq!(row["audit"], serde_json::json!([]));
    let mut show_text = vec!["show"];
    show_text.extend(scope("pay-1"));
    let text = cli(&url, &show_text).await;
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.contains("pending step:    charge"), "{text:?}");

    let body = std::env::temp_dir().join(format!(
        "cli-body-{}-{}.json",
        DB::LABEL,
        std::process::id()
    ));
    std::fs::write(&body, r#"{"chargeId":"ch_operator"}"#).unwrap();
    let body_arg = body.display().to_string();
    let (generation, parks) = (row["generation"].to_string(), row["parks"].to_string());
    let mut resolve = vec!["resolve"];
    resolve.extend(scope("pay-1"));
    resolve.extend([
        "--expect-generation",
        &generation,
        "--expect-parks",
        &parks,
        "--succeeded",
        "--status",
        "201",
        "--body-file",
        &body_arg,
        "--header",
        "content-type: application/json",
        "--reason",
        "provider shows ch_operator for the step key",
    ]);
    let mut dry = resolve.clone();
    dry.push("--dry-run");
    let would = cli(&url, &dry).await;
    assert_eq!(would.code, 0, "{would:?}");
    assert!(
        would.stdout.contains("would record succeeded 201"),
        "{would:?}"
    );
    let still = cli(&url, &["unresolved", "--json"]).await;
    assert_eq!(still.json_lines().len(), 1, "a dry run changes nothing");

    // No --actor: the OS user ($USER).
    let done = cli_as(&url, "alice", &resolve).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(done.stdout.contains("NEEDS_RECONCILIATION"), "{done:?}");
    assert!(done.stdout.contains("SUCCEEDED 201"), "{done:?}");
    assert!(done.stdout.contains("by alice"), "{done:?}");
    std::fs::remove_file(&body).unwrap();

    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.status, 201);
    assert_eq!(&retry.body[..], br#"{"chargeId":"ch_operator"}"#);
    assert_eq!(retry.headers["content-type"], "application/json");

    let row = cli(&url, &show).await.one_json();
    assert_eq!(row["status"], "SUCCEEDED");
    assert_eq!(row["response_body"], r#"{"chargeId":"ch_operator"}"#);
    let audit = row["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "{row}");
    assert_eq!(audit[0]["actor"], "alice");
    assert_eq!(audit[0]["verdict"], "succeeded");
    assert_eq!(audit[0]["before"]["status"], "NEEDS_RECONCILIATION");
    let listed = cli(&url, &["unresolved", "--json"]).await;
    assert_eq!((listed.code, listed.stdout.as_str()), (0, ""));
}

async fn refusals_exit_1_with_one_line<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    let url = DB::url_of(&h.pool);
    park(&app, "pay-1").await;
    let mut show = vec!["show", "--json"];
    show.extend(scope("pay-1"));
    let seen = cli(&url, &show).await.one_json();
    let (generation, parks) = (seen["generation"].to_string(), seen["parks"].to_string());
    let mut rerun = vec![
        "resolve",
        "--rerun",
        "--reason",
        "provider shows no charge",
        "--actor",
        "bob",
        "--expect-generation",
        &generation,
        "--expect-parks",
        &parks,
    ];
    rerun.extend(scope("pay-1"));
    let first = cli(&url, &rerun).await;
    assert_eq!(first.code, 0, "{first:?}");
    assert!(first.stdout.contains("PROCESSING"), "{first:?}");
    // The retry runs the step again (same step key): the payment completes.
    app.state.provider.lookup_down(false);
    let retry = send(&app.router, payment("pay-1", PAY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(app.state.provider.charges(), 1, "the provider deduplicated");

    // Settled first (by the retry, after bob's rerun): who won, and what it is now.
    let mut late = rerun.clone();
    late.push("--json");
    let refused = cli(&url, &late).await;
    refused.assert_failed(1, "settled first");
    assert!(refused.stderr.contains("SUCCEEDED 201"), "{refused:?}");
    // Bob's verdict was a rerun: the retry settled it, not Bob.
    assert!(
        refused.stderr.contains("settled first by the service"),
        "{refused:?}"
    );
    assert!(!refused.stderr.contains("bob"), "{refused:?}");
    let detail = refused.one_json();
    assert_eq!(detail["refused"], "settled");
    assert_eq!(detail["settled_by"], Value::Null, "{detail}");
    assert_eq!(detail["record"]["status"], "SUCCEEDED");
    let mut dry = rerun.clone();
    dry.push("--dry-run");
    cli(&url, &dry).await.assert_failed(1, "settled first");

    // Not found.
    let mut missing = vec!["resolve", "--rerun", "--reason", "x"];
    missing.extend(scope("no-such-key"));
    cli(&url, &missing).await.assert_failed(1, "no record");
    let mut show = vec!["show"];
    show.extend(scope("no-such-key"));
    cli(&url, &show).await.assert_failed(1, "no record");

    // Bad usage: exit 2, one line.
    let mut no_reason = vec!["resolve", "--rerun"];
    no_reason.extend(scope("pay-1"));
    cli(&url, &no_reason).await.assert_failed(2, "--reason");
    let mut no_status = vec!["resolve", "--succeeded", "--reason", "x"];
    no_status.extend(scope("pay-1"));
    cli(&url, &no_status).await.assert_failed(2, "--status");
    let mut two = vec!["resolve", "--rerun", "--failed", "--reason", "x"];
    two.extend(scope("pay-1"));
    cli(&url, &two)
        .await
        .assert_failed(2, "cannot be used with");
    cli(&url, &["unresolved", "--limit", "0"])
        .await
        .assert_failed(2, "--limit");
    cli(&url, &["frobnicate"])
        .await
        .assert_failed(2, "frobnicate");
    // No database.
    cli("", &["status"]).await.assert_failed(2, "DATABASE_URL");
    // Nobody listens there (issue 26, point 6): said at once, as refused,
    // never as a pool that timed out after 10 s.
    for nobody in [
        "postgres://postgres@127.0.0.1:1/nothing",
        "mysql://root@127.0.0.1:1/nothing",
    ] {
        let refused = cli(nobody, &["status"]).await;
        refused.assert_failed(2, "no database at the URL given");
        assert!(refused.stderr.contains("refused"), "{refused:?}");
    }
    cli("redis://127.0.0.1/0", &["status"])
        .await
        .assert_failed(2, "unsupported");
    cli("sqlite:///nonexistent-dir/ledger.db", &["status"])
        .await
        .assert_failed(2, "no database");
}

async fn a_held_record_is_refused<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    let url = DB::url_of(&h.pool);
    // The charge hangs: the attempt holds a live lease with the step pending.
    app.state
        .provider
        .fault(Fault::ChargeThenHang(Duration::from_secs(3)));
    let router = app.router.clone();
    let paying = tokio::spawn(async move { send(&router, payment("pay-1", PAY)).await });
    let mut show = vec!["show", "--json"];
    show.extend(scope("pay-1"));
    let start = Instant::now();
    let seen = loop {
        let out = cli(&url, &show).await;
        if out.code == 0 && out.one_json()["pending_step"] == "charge" {
            break out.one_json();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the step is pending: {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (generation, parks) = (seen["generation"].to_string(), seen["parks"].to_string());
    let mut rerun = vec![
        "resolve",
        "--rerun",
        "--reason",
        "impatient",
        "--expect-generation",
        &generation,
        "--expect-parks",
        &parks,
    ];
    rerun.extend(scope("pay-1"));
    // A dry run makes the same check as the verdict.
    let mut dry = rerun.clone();
    dry.push("--dry-run");
    cli(&url, &dry)
        .await
        .assert_failed(1, "holds the record's lease");
    cli(&url, &rerun)
        .await
        .assert_failed(1, "holds the record's lease");
    let paid = paying.await.unwrap();
    assert_eq!(paid.status, 201, "{paid:?}");
    assert_eq!(
        DB::count(&h.pool, "SELECT COUNT(*) FROM tower_idempotency_audit").await,
        0
    );
}

async fn sweep_status_and_migrate<DB: Store>() {
    // A new, empty database: migrate prints each version, then nothing.
    let (url, _drop) = DB::fresh_url().await;
    let first = cli(&url, &["migrate", "--json"]).await;
    assert_eq!(first.code, 0, "{first:?}");
    let applied = first.json_lines();
    let (expected, last) = match DB::LABEL {
        "postgres" => (8, "scope_lock_wait"),
        "mysql" => (8, "ledger_table_name"),
        _ => (6, "operator_audit"),
    };
    assert_eq!(applied.len(), expected, "{first:?}");
    assert_eq!(applied[0]["applied"], 1);
    assert!(
        applied[expected - 1]["name"]
            .as_str()
            .unwrap()
            .ends_with(last),
        "{first:?}"
    );
    let again = cli(&url, &["migrate"]).await;
    assert_eq!(
        (again.code, again.stdout.trim()),
        (0, "the ledger is up to date")
    );

    let (h, app) = pay_app::<DB>().await;
    let url = DB::url_of(&h.pool);
    park(&app, "pay-1").await;
    DB::seed_expired(&h.pool, 5).await;
    let dry = cli(&url, &["sweep", "--dry-run", "--json"]).await;
    assert_eq!(dry.code, 0, "{dry:?}");
    let would = dry.one_json();
    assert_eq!(
        (
            would["would_expire"].as_i64(),
            would["would_purge"].as_i64()
        ),
        (Some(5), Some(0))
    );
    let swept = cli(&url, &["sweep", "--json"]).await;
    assert_eq!(swept.code, 0, "{swept:?}");
    // Seeded rows expired in 1970: their tombstones are past purging too.
    let report = swept.one_json();
    assert_eq!(
        (report["expired"].as_i64(), report["purged"].as_i64()),
        (Some(5), Some(5)),
        "{report}"
    );
    let text = cli(&url, &["sweep"]).await;
    assert!(text.stdout.contains("expired 0 and purged 0"), "{text:?}");

    let status = cli(&url, &["status", "--json"]).await;
    assert_eq!(status.code, 0, "{status:?}");
    let s = status.one_json();
    assert_eq!(
        (
            s["total"].as_i64(),
            s["tombstones"].as_i64(),
            s["parked"].as_i64()
        ),
        (Some(1), Some(0), Some(1)),
        "{s}"
    );
    assert_eq!(s["unresolved"], 1);
    assert!(s["size_bytes"].as_i64().is_some_and(|b| b > 0), "{s}");
    let estimates = s["estimates"].as_array().unwrap();
    assert_eq!(estimates.is_empty(), DB::LABEL != "mysql", "{s}");
    let text = cli(&url, &["status"]).await;
    assert!(text.stdout.contains("parked:              1"), "{text:?}");
    assert!(text.stdout.contains("estimates:"), "{text:?}");
}

/// The default mode: a handler that committed the layer's transaction
/// itself leaves its key held (`NEEDS_RECONCILIATION`, generation 0, no
/// step key); `--rerun` deletes the record and the key runs afresh.
async fn a_default_mode_record_is_rerun_by_deleting_it<DB: Store>() {
    use tower_idempotency::testkit::{Harness, order};
    let h = Harness::<DB>::new().await;
    let url = DB::url_of(&h.pool);
    let app = h.app();
    let body = r#"{"amount":1,"mode":"commit_503"}"#;
    let a = send(&app, order(Some("alice"), Some("k-1"), body)).await;
    assert_eq!(a.status, 500, "{a:?}");
    let listed = cli(&url, &["unresolved", "--json"]).await.one_json();
    assert_eq!(listed["generation"], 0, "{listed}");
    assert_eq!(listed["step_key"], Value::Null, "{listed}");
    assert_eq!(
        listed["response_status"], 503,
        "the handler's answer: {listed}"
    );
    let done = cli(
        &url,
        &[
            "resolve",
            "--principal",
            "alice",
            "--operation",
            "POST /orders",
            "--key",
            "k-1",
            "--rerun",
            "--reason",
            "nothing was charged",
        ],
    )
    .await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(done.stdout.contains("deleted"), "{done:?}");
    let retry = send(&app, order(Some("alice"), Some("k-1"), r#"{"amount":1}"#)).await;
    assert_eq!(retry.status, 201, "runs afresh: {retry:?}");
    assert!(!retry.replayed());
}

/// Two operators look at one parked record. Alice reruns it (it becomes
/// `PROCESSING` at the next generation, its lease lapsed); Bob, from the
/// same earlier `show`, records it succeeded: refused, nothing written,
/// one line saying what the record is now. A lease-mode record cannot be
/// resolved without naming it as seen.
async fn a_verdict_on_a_record_that_moved_since_show_is_refused<DB: Store>() {
    let (h, app) = pay_app::<DB>().await;
    let url = DB::url_of(&h.pool);
    park(&app, "pay-1").await;
    let mut show = vec!["show", "--json"];
    show.extend(scope("pay-1"));
    let seen = cli(&url, &show).await.one_json();
    let generation = seen["generation"].as_i64().unwrap();
    let parks = seen["parks"].as_i64().unwrap();
    let claim = seen["claim_id"].as_str().unwrap().to_string();
    let (g, p) = (generation.to_string(), parks.to_string());
    let mut show_text = vec!["show"];
    show_text.extend(scope("pay-1"));
    let text = cli(&url, &show_text).await;
    for line in [
        format!("generation:      {g}"),
        format!("parks:           {p}"),
        format!("claim id:        {claim}"),
        format!("--expect-generation {g} --expect-parks {p}"),
    ] {
        assert!(text.stdout.contains(&line), "{line:?} in {text:?}");
    }

    // Alice reruns it, as she saw it.
    let mut alice = vec![
        "resolve",
        "--rerun",
        "--reason",
        "provider shows no charge",
        "--actor",
        "alice",
        "--expect-generation",
        &g,
        "--expect-parks",
        &p,
        "--expect-claim",
        &claim,
    ];
    alice.extend(scope("pay-1"));
    let done = cli(&url, &alice).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(done.stdout.contains("PROCESSING"), "{done:?}");

    // Bob, from the same show: refused, with what the record is now.
    let mut bob = vec![
        "resolve",
        "--succeeded",
        "--status",
        "201",
        "--reason",
        "provider shows a charge",
        "--actor",
        "bob",
    ];
    bob.extend(scope("pay-1"));
    let mut stale = bob.clone();
    stale.extend(["--expect-generation", &g, "--expect-parks", &p]);
    let now = format!("PROCESSING, generation {}", generation + 1);
    let refused = cli(&url, &stale).await;
    refused.assert_failed(1, &now);
    assert!(refused.stderr.contains("moved"), "{refused:?}");
    let mut dry = stale.clone();
    dry.push("--dry-run");
    cli(&url, &dry).await.assert_failed(1, &now);
    // Not naming the record as seen: the verdict would apply to the
    // record as it is now (the dry run says so, and writes nothing).
    let mut as_now = bob.clone();
    as_now.push("--dry-run");
    let would = cli(&url, &as_now).await;
    assert_eq!(would.code, 0, "{would:?}");
    assert!(would.stdout.contains("would record"), "{would:?}");

    let row = cli(&url, &show).await.one_json();
    assert_eq!(row["status"], "PROCESSING", "{row}");
    let audit = row["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1, "only Alice's verdict: {row}");
    assert_eq!(audit[0]["actor"], "alice");
}

/// Issue 26, points 4 and 9: `unresolved` prints each scope whole (a UUID
/// key, a long principal), so it can be pasted into `show`; and neither
/// `unresolved` nor `show` writes stored control characters (a terminal
/// escape sequence) to the terminal raw.
async fn unresolved_and_show_print_scopes_whole_and_escaped<DB: Store>() {
    use tower_idempotency::store::{Claim, Scope};
    let (pool, _drop) = DB::fresh().await;
    let url = DB::url_of(&pool);
    let database = DB::database(&pool);
    let principal = "tenant-with-a-rather-long-name-\u{1b}[31m-red";
    let operation = "POST /payments";
    let key = "8e03978e-40d1-4c5b-9d2e-0123456789ab";
    let claim = Claim {
        scope: Scope {
            principal,
            operation,
            key,
        },
        fingerprint: &[7; 32],
        retention_ms: 86_400_000,
        lock_wait: Duration::ZERO,
        isolation: Default::default(),
        cached_statements: true,
        database: database.as_deref(),
        causal_wait: true,
    };
    DB::mark_unresolved(&pool, &claim, 500).await.unwrap();
    let table = cli(&url, &["unresolved"]).await;
    assert_eq!(table.code, 0, "{table:?}");
    assert!(table.stdout.contains(key), "the key whole: {table:?}");
    assert!(!table.stdout.contains('\u{1b}'), "no raw escape: {table:?}");
    assert!(table.stdout.contains("\\x1b[31m-red"), "{table:?}");
    let shown = cli(
        &url,
        &[
            "show",
            "--principal",
            principal,
            "--operation",
            operation,
            "--key",
            key,
        ],
    )
    .await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(!shown.stdout.contains('\u{1b}'), "no raw escape: {shown:?}");
    assert!(shown.stdout.contains("\\x1b[31m-red"), "{shown:?}");
}

/// `--key '"abc"'` is the header as sent, so it names the key the layer
/// stored as `abc`; when a stored key `"abc"` (quotes included) exists
/// beside it, both are listed and no verdict lands without `--stored`.
async fn a_quoted_key_is_read_as_sent_and_an_ambiguous_one_is_never_resolved<DB: Store>() {
    use tower_idempotency::store::{Claim, Scope};
    let (pool, _drop) = DB::fresh().await;
    let url = DB::url_of(&pool);
    let database = DB::database(&pool);
    for key in ["abc", "\"abc\"", "xyz"] {
        let claim = Claim {
            scope: Scope {
                principal: PAYER,
                operation: OPERATION,
                key,
            },
            fingerprint: &[7; 32],
            retention_ms: 86_400_000,
            lock_wait: Duration::ZERO,
            isolation: Default::default(),
            cached_statements: true,
            database: database.as_deref(),
            causal_wait: true,
        };
        DB::mark_unresolved(&pool, &claim, 500).await.unwrap();
    }
    let keys_of = |out: &Out| -> Vec<String> {
        out.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("  key:       ").map(str::to_string))
            .collect()
    };

    // Unambiguous: the header `"xyz"` names the key stored as `xyz`.
    let mut args = vec!["show", "--json"];
    args.extend(scope("\"xyz\""));
    let one = cli(&url, &args).await;
    assert_eq!(one.code, 0, "{one:?}");
    assert_eq!(one.one_json()["key"], "xyz");

    // Ambiguous: both listed, the reading as sent first; refused.
    let mut args = vec!["show"];
    args.extend(scope("\"abc\""));
    let both = cli(&url, &args).await;
    both.assert_failed(1, "ambiguous");
    assert_eq!(keys_of(&both), ["abc", "\"abc\""], "{both:?}");

    let mut args = vec!["resolve", "--rerun", "--reason", "mistyped", "--json"];
    args.extend(scope("\"abc\""));
    let refused = cli(&url, &args).await;
    refused.assert_failed(1, "ambiguous");
    assert_eq!(
        refused.one_json()["records"].as_array().map(Vec::len),
        Some(2)
    );
    for key in ["abc", "\"abc\""] {
        let row = DB::row(
            &pool,
            &Scope {
                principal: PAYER,
                operation: OPERATION,
                key,
            },
        )
        .await
        .unwrap()
        .expect("nothing settled");
        assert_eq!(row.status.as_str(), "NEEDS_RECONCILIATION", "{key}");
    }

    // --stored names the record whose stored key is `"abc"`, and only it.
    let mut args = vec!["show", "--json", "--stored"];
    args.extend(scope("\"abc\""));
    let stored = cli(&url, &args).await;
    assert_eq!(stored.code, 0, "{stored:?}");
    assert_eq!(stored.one_json()["key"], "\"abc\"");
    let mut args = vec![
        "resolve",
        "--stored",
        "--rerun",
        "--reason",
        "the quoted one",
    ];
    args.extend(scope("\"abc\""));
    let done = cli(&url, &args).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(
        DB::row(
            &pool,
            &Scope {
                principal: PAYER,
                operation: OPERATION,
                key: "\"abc\""
            }
        )
        .await
        .unwrap()
        .is_none()
    );
    let kept = DB::row(
        &pool,
        &Scope {
            principal: PAYER,
            operation: OPERATION,
            key: "abc",
        },
    )
    .await
    .unwrap()
    .expect("the other record is untouched");
    assert_eq!(kept.status.as_str(), "NEEDS_RECONCILIATION");
}

/// A default-mode record whose handler ran `COMMIT` itself and then
/// answered `201`: its client got `500 #transaction-ended`, and the record
/// is parked. `status`, `unresolved` and `show` say the same of it (parked,
/// parked once), none presents the handler's `201` as the answer (the
/// client was never given it), and `show` prints the `resolve with:` flags
/// the guide promises, which name the record: a verdict with them lands,
/// and one naming it as it was before the layer parked it is refused.
async fn a_record_whose_handler_committed_reads_alike_in_status_show_and_unresolved<DB: Store>() {
    use tower_idempotency::testkit::{Harness, order};
    let h = Harness::<DB>::new().await;
    let url = DB::url_of(&h.pool);
    let app = h.app();
    let a = send(
        &app,
        order(
            Some("alice"),
            Some("k-1"),
            r#"{"amount":1,"mode":"commit_201"}"#,
        ),
    )
    .await;
    assert_eq!(a.status, 500, "the client got 500: {a:?}");
    let scope = [
        "--principal",
        "alice",
        "--operation",
        "POST /orders",
        "--key",
        "k-1",
    ];

    let status = cli(&url, &["status", "--json"]).await.one_json();
    assert_eq!(status["parked"], 1, "{status}");
    let mut show = vec!["show", "--json"];
    show.extend(scope);
    let row = cli(&url, &show).await.one_json();
    assert_eq!(row["status"], "NEEDS_RECONCILIATION", "{row}");
    assert_eq!(row["parks"], 1, "parked, so parked once: {row}");

    let status_text = cli(&url, &["status"]).await;
    assert!(
        status_text.stdout.contains("parked:              1"),
        "{status_text:?}"
    );
    let mut show_text = vec!["show"];
    show_text.extend(scope);
    let text = cli(&url, &show_text).await;
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.contains("parks:           1"), "{text:?}");
    assert!(
        !text.stdout.contains("answer status"),
        "the client never got the handler's 201: {text:?}"
    );
    assert!(
        text.stdout
            .lines()
            .any(|l| l.starts_with("handler status:  201 ") && l.contains("never sent")),
        "{text:?}"
    );
    let flags = text
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("resolve with:    "))
        .unwrap_or_else(|| panic!("no resolve with: line: {text:?}"));
    assert_eq!(flags, "--expect-generation 0 --expect-parks 1", "{text:?}");

    let listed = cli(&url, &["unresolved"]).await;
    assert!(
        listed
            .stdout
            .lines()
            .next()
            .is_some_and(|h| h.contains("HANDLER") && !h.contains("LAST")),
        "{listed:?}"
    );

    // Seen before the layer parked it (PROCESSING, parks 0): refused, dry
    // run or not, and nothing written.
    for dry in [true, false] {
        let mut stale = vec!["resolve"];
        stale.extend(scope);
        stale.extend(["--expect-generation", "0", "--expect-parks", "0"]);
        stale.extend(["--rerun", "--reason", "seen as PROCESSING"]);
        if dry {
            stale.push("--dry-run");
        }
        let refused = cli(&url, &stale).await;
        refused.assert_failed(1, "moved since it was seen");
    }
    let row = cli(&url, &show).await.one_json();
    assert_eq!(row["status"], "NEEDS_RECONCILIATION", "{row}");
    assert_eq!(row["audit"], serde_json::json!([]), "{row}");

    let mut resolve = vec!["resolve"];
    resolve.extend(scope);
    resolve.extend(flags.split(' '));
    resolve.extend(["--rerun", "--reason", "the order row is not there"]);
    let done = cli(&url, &resolve).await;
    assert_eq!(done.code, 0, "the printed flags name the record: {done:?}");
}
