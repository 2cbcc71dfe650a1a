//! The operators' guide run as written: every command of
//! `docs/operating.md` (and the example pair of `docs/lease-mode.md` it
//! relies on), against the example payment service on a fresh database of
//! every store, each output checked against what the guide shows. A
//! command the guide gains is run here, or listed in [`NOT_RUN`] with why;
//! otherwise this test fails.

#[macro_use]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::ledger::Store;
use tower_idempotency::testkit::ConformanceDb;

on_every_store!(
    the_runbook_runs_as_written,
    the_transaction_ended_runbook_runs_as_written,
);

/// The runbooks of `docs/operating.md`, each run by its test here.
const RUNBOOKS: &[&str] = &[
    "## Runbook: a parked payment",
    "## Runbook: a handler that ended the transaction",
];

/// Commands the guides show that this test does not run, and why.
const NOT_RUN: &[(&str, &str)] = &[
    (
        "cargo install tower-idempotency",
        "installs the published crate; the test runs the binary this build made",
    ),
    (
        "export DATABASE_URL=",
        "the test sets DATABASE_URL to a fresh database itself",
    ),
];

/// A command of a guide, and the output the guide shows for it (a
/// `text` block's lines after its `$ ` line).
#[derive(Debug, Clone)]
struct Shown {
    command: String,
    output: Vec<String>,
}

/// The part of `markdown` under `heading`, up to the next `## ` heading.
fn section(markdown: &str, heading: &str) -> String {
    let start = markdown
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?}"));
    let rest = &markdown[start + 1..];
    let end = rest[heading.len()..]
        .find("\n## ")
        .map_or(rest.len(), |e| e + heading.len());
    rest[..end].to_string()
}

/// Every command of `docs/operating.md` is in a runbook these tests run,
/// or listed in [`NOT_RUN`].
#[test]
fn every_command_of_the_guide_is_run_or_said_not_to_be() {
    let guide = read("docs/operating.md");
    let run: Vec<String> = RUNBOOKS
        .iter()
        .flat_map(|h| commands(&section(&guide, h)))
        .map(|c| c.command)
        .collect();
    let all = commands(&guide);
    assert!(all.len() >= 8, "{all:?}");
    for c in all {
        let not_run = NOT_RUN.iter().any(|(p, _)| c.command.starts_with(p));
        assert!(
            run.contains(&c.command) || not_run,
            "a command of docs/operating.md nobody runs: {c:?}"
        );
    }
}

fn read(doc: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(doc))
        .unwrap_or_else(|e| panic!("{doc}: {e}"))
}

/// Every command `markdown` shows, in order: the lines of its `sh` blocks
/// (continuation lines joined, comments dropped), the `$ ` lines of its
/// `text` blocks with the output under them, and inline code that starts
/// with `tower-idempotency ` or `curl `.
fn commands(markdown: &str) -> Vec<Shown> {
    let mut out: Vec<Shown> = Vec::new();
    let mut block: Option<String> = None;
    let mut indent = 0;
    let mut current = String::new();
    for line in markdown.lines() {
        if let Some(fence) = line.trim_start().strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(fence.to_string()),
            };
            // A block in a list item: its lines as the reader sees them.
            indent = line.len() - line.trim_start().len();
            continue;
        }
        let line = line
            .get(indent..)
            .filter(|_| block.is_some())
            .unwrap_or(line);
        match block.as_deref() {
            Some("sh") => {
                let line = line.split("  #").next().unwrap_or_default().trim_end();
                if line.trim_start().starts_with('#') || line.trim().is_empty() {
                    continue;
                }
                match line.strip_suffix('\\') {
                    Some(part) => current.push_str(part.trim_start()),
                    None => {
                        current.push_str(line.trim_start());
                        out.push(Shown {
                            command: std::mem::take(&mut current),
                            output: Vec::new(),
                        });
                    }
                }
            }
            Some("text") => match line.trim_start().strip_prefix("$ ") {
                Some(command) => out.push(Shown {
                    command: command.to_string(),
                    output: Vec::new(),
                }),
                None => {
                    if let Some(last) = out.last_mut() {
                        last.output.push(line.to_string());
                    }
                }
            },
            Some(_) => {}
            None => {
                for (i, span) in line.split('`').enumerate() {
                    if i % 2 == 1
                        && (span.starts_with("tower-idempotency ") || span.starts_with("curl "))
                    {
                        out.push(Shown {
                            command: span.to_string(),
                            output: Vec::new(),
                        });
                    }
                }
            }
        }
    }
    // An inline span broken over two lines is not a command.
    out.retain(|c| !c.command.is_empty());
    out
}

/// What a command printed.
#[derive(Debug)]
struct Ran {
    code: i32,
    stdout: String,
    #[expect(dead_code, reason = "shown through Debug in failure messages")]
    stderr: String,
}

/// Runs `command` with `sh`, in `dir`, the CLI this build made first on
/// `PATH`, `DATABASE_URL` = `url`, `USER` = `alice`.
async fn sh(command: &str, dir: &Path, url: &str) -> Ran {
    let cli = PathBuf::from(env!("CARGO_BIN_EXE_tower-idempotency"));
    let path = format!(
        "{}:{}",
        cli.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("sh")
            .args(["-c", command])
            .current_dir(dir)
            .env("PATH", path)
            .env("DATABASE_URL", url)
            .env("USER", "alice")
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{command} ends within 60 s"))
    .expect("sh");
    Ran {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A `curl -s` call of the test's own (faults of the provider).
async fn post_json(addr: &str, path: &str, body: &str, dir: &Path) {
    let ran = sh(
        &format!(
            "curl -sf -X POST -H 'content-type: application/json' -d '{body}' http://{addr}{path}"
        ),
        dir,
        "",
    )
    .await;
    assert_eq!(ran.code, 0, "{path} {body}: {ran:?}");
}

/// A `cargo run --example NAME -- ARGS [&]` line of a guide: `NAME` and
/// its arguments.
fn example_line(command: &str) -> Option<(String, Vec<String>)> {
    let rest = command.strip_prefix("cargo run --example ")?;
    let rest = rest.trim_end().trim_end_matches('&').trim_end();
    let (name, args) = rest.split_once(" -- ").unwrap_or((rest, ""));
    Some((
        name.to_string(),
        args.split_whitespace().map(str::to_string).collect(),
    ))
}

/// `args` with every `--addr` given port 0 (a free one) and every
/// `--provider` pointed at the running provider.
fn local(args: &[String], provider: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        out.push(a.clone());
        match a.as_str() {
            "--addr" => {
                it.next();
                out.push("127.0.0.1:0".into());
            }
            "--provider" => {
                it.next();
                out.push(format!("http://{}", provider.expect("the provider runs")));
            }
            _ => {}
        }
    }
    out
}

/// The runbook of `docs/operating.md` on a payment parked by the example
/// pair of `docs/lease-mode.md`, each command as the guides write it
/// (addresses mapped to the running processes, `<step key>` to the record's
/// step key), each output against what the guide shows.
async fn the_runbook_runs_as_written<DB: ConformanceDb>() {
    let (url, _drop) = DB::fresh_url().await;
    let dir =
        std::env::temp_dir().join(format!("ti-operating-{}-{}", DB::LABEL, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let pair = commands(&read("docs/lease-mode.md"));
    let guide = commands(&section(&read("docs/operating.md"), RUNBOOKS[0]));
    assert_eq!(guide.len(), 4, "the four commands run below: {guide:?}");

    // The example pair, as docs/lease-mode.md starts it. No completer pass
    // while the operator works: one would take the parked payment and park
    // it again (which the guide describes: the verdict is then refused).
    let (name, args) = example_line(&pair[0].command).expect("the provider's line");
    assert_eq!(name, "fake_provider", "{pair:?}");
    let (_provider, provider) = common::start_example(
        &name,
        &local(&args, None)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &[],
    )
    .await;
    let (name, args) = example_line(&pair[1].command).expect("the service's line");
    assert_eq!(name, "payment_service", "{pair:?}");
    let mut args = local(&args, Some(&provider));
    args.extend(["--completer-interval-ms".into(), "600000".into()]);
    let (_service, service) = common::start_example(
        &name,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[("DATABASE_URL", &url)],
    )
    .await;
    let at = |c: &str| {
        c.replace("localhost:3100", &provider)
            .replace("localhost:3002", &service)
    };

    // The payment, its charge made and the answer lost, the look-up down:
    // parked (the runbook's situation).
    post_json(&provider, "/faults", r#"{"mode":"charge_then_drop"}"#, &dir).await;
    post_json(&provider, "/faults", r#"{"mode":"lookup_down"}"#, &dir).await;
    let pay = at(&pair[2].command);
    assert!(pay.starts_with("curl -si "), "{pay}");
    let parked = sh(&pay, &dir, &url).await;
    assert!(
        parked.stdout.starts_with("HTTP/1.1 503") && parked.stdout.contains("#reconciling"),
        "{parked:?}"
    );
    post_json(&provider, "/faults", r#"{"mode":"lookup_up"}"#, &dir).await;

    // 1. Find it: the listing as the guide shows it.
    let list = &guide[0];
    assert_eq!(list.command, "tower-idempotency unresolved", "{guide:?}");
    let ran = sh(&list.command, &dir, &url).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let got: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(got.len(), list.output.len(), "{ran:?} against {list:?}");
    assert_eq!(got[0], list.output[0], "the header as the guide shows it");
    // The row: every column as shown but the age and the step key (the
    // guide clips the key).
    let columns = |l: &str| -> (Vec<String>, String) {
        let t: Vec<String> = l.split_whitespace().map(str::to_string).collect();
        let n = t.len();
        let mut kept = t[..4].to_vec();
        kept.push(t[n - 2].clone());
        (kept, t[n - 1].clone())
    };
    let (shown_row, shown_key) = columns(&list.output[1]);
    let (got_row, step_key) = columns(got[1]);
    assert_eq!(got_row, shown_row, "{ran:?} against {list:?}");
    let clipped = shown_key.trim_end_matches('…');
    assert!(
        clipped.len() >= 8 && clipped.chars().all(|c| c.is_ascii_hexdigit()),
        "{shown_key}"
    );
    assert!(
        step_key.len() > clipped.len() && step_key.chars().all(|c| c.is_ascii_hexdigit()),
        "{step_key}"
    );
    assert_eq!(
        &got[2..],
        &list.output[2..],
        "the scope as the guide shows it"
    );

    // 2. Look at it: the fields the guide names, and the flags.
    let show = &guide[1];
    assert!(
        show.command.starts_with("tower-idempotency show "),
        "{show:?}"
    );
    let shown = sh(&show.command, &dir, &url).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    for field in ["generation:", "parks:", "claim id:", "step key:"] {
        assert!(
            shown.stdout.lines().any(|l| l.starts_with(field)),
            "{field} {shown:?}"
        );
    }
    assert!(
        shown
            .stdout
            .contains(&format!("step key:        {step_key}")),
        "{shown:?}"
    );
    let flags = shown
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("resolve with:    "))
        .unwrap_or_else(|| panic!("no resolve with: {shown:?}"))
        .to_string();
    let claim = shown
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("claim id:        "))
        .unwrap()
        .to_string();

    // 3. Check the provider with the step key: it has the charge.
    let lookup = &guide[2];
    assert!(lookup.command.contains("<step key>"), "{lookup:?}");
    let ran = sh(
        &format!(
            "{} -si",
            at(&lookup.command).replace("<step key>", &step_key)
        ),
        &dir,
        &url,
    )
    .await;
    assert!(ran.stdout.starts_with("HTTP/1.1 200"), "{ran:?}");

    // 4. Settle it as the guide writes it: the flags are those `show`
    // printed, `--dry-run` first.
    let resolve = &guide[3];
    assert!(
        resolve.command.starts_with("tower-idempotency resolve "),
        "{resolve:?}"
    );
    let expect = resolve
        .command
        .split(" --")
        .filter(|f| f.starts_with("expect-"))
        .map(|f| format!("--{}", f.trim()))
        .collect::<Vec<_>>()
        .join(" ");
    assert_eq!(
        format!("{expect} --expect-claim {claim}"),
        flags,
        "the guide's resolve names the record as show printed it"
    );
    std::fs::write(
        dir.join("answer.json"),
        r#"{"paymentId":"settled-by-operator","status":"captured"}"#,
    )
    .unwrap();
    let dry = sh(&format!("{} --dry-run", resolve.command), &dir, &url).await;
    assert_eq!(dry.code, 0, "{dry:?}");
    assert!(
        dry.stdout.starts_with("would record succeeded 201"),
        "{dry:?}"
    );
    let done = sh(&resolve.command, &dir, &url).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(
        done.stdout.contains("-> SUCCEEDED 201, by alice"),
        "prints what it changed: {done:?}"
    );

    // 5. Confirm the retry replays, and `show` lists the audit row.
    let retry = sh(&pay, &dir, &url).await;
    assert!(retry.stdout.starts_with("HTTP/1.1 201"), "{retry:?}");
    assert!(
        retry
            .stdout
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{retry:?}"
    );
    assert!(retry.stdout.contains("settled-by-operator"), "{retry:?}");
    let after = sh(&show.command, &dir, &url).await;
    assert!(
        after
            .stdout
            .lines()
            .any(|l| l.starts_with("audit #") && l.contains("succeeded by alice")),
        "{after:?}"
    );
    assert!(after.stdout.contains("answer status:   201"), "{after:?}");
    assert!(
        !after.stdout.contains("resolve with:"),
        "settled: {after:?}"
    );

    cli_reference(&dir, &url).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CLI reference's rows: each subcommand run in its plainest form
/// (`show` and `resolve` ran in the runbook), printing what its row says.
async fn cli_reference(dir: &Path, url: &str) {
    for (command, says) in [
        ("tower-idempotency migrate", "the ledger is up to date"),
        ("tower-idempotency status", "parked:"),
        (
            "tower-idempotency status --stranded-after 60",
            "unresolved:",
        ),
        (
            "tower-idempotency unresolved --limit 1",
            "nothing unresolved",
        ),
        (
            "tower-idempotency sweep --dry-run",
            "would expire 0 and purge 0",
        ),
        ("tower-idempotency sweep", "expired 0 and purged 0"),
        ("tower-idempotency --json status", "\"parked\":0"),
    ] {
        let ran = sh(command, dir, url).await;
        assert_eq!(ran.code, 0, "{command}: {ran:?}");
        assert!(ran.stdout.contains(says), "{command}: {says:?} in {ran:?}");
    }
}

/// The rows of the first table under `heading`: the lines from its header
/// up to the first line that is not a table row. Rows after a paragraph
/// that breaks the table are not in it (a Markdown renderer shows them as
/// text).
fn table_under<'a>(markdown: &'a str, heading: &str) -> Vec<&'a str> {
    markdown
        .lines()
        .skip_while(|l| *l != heading)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .collect()
}

/// The subcommands `tower-idempotency --help` lists.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The CLI reference is one table with a row per subcommand the binary
/// has, and every flag a row shows is one its subcommand takes.
#[tokio::test]
async fn the_cli_reference_is_one_table_of_every_subcommand_and_flag() {
    let dir = std::env::temp_dir();
    let guide = read("docs/operating.md");
    let rows = table_under(&guide, "## CLI reference");
    let help = sh("tower-idempotency --help", &dir, "").await;
    assert_eq!(help.code, 0, "{help:?}");
    let mut listed: Vec<String> = Vec::new();
    for row in &rows {
        let usage = row.split('`').nth(1).unwrap_or_default();
        let sub = usage.split_whitespace().next().unwrap_or_default();
        if !listed.iter().any(|l| l == sub) {
            listed.push(sub.to_string());
        }
        let sub_help = sh(&format!("tower-idempotency {sub} --help"), &dir, "").await;
        assert_eq!(sub_help.code, 0, "{row}: {sub_help:?}");
        for flag in usage
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|f| f.starts_with("--"))
        {
            assert!(
                sub_help.stdout.contains(flag),
                "{sub} takes no {flag}: {row}"
            );
        }
    }
    assert_eq!(
        listed,
        subcommands(&help.stdout),
        "the CLI reference's table against tower-idempotency --help"
    );
    for flag in ["--database-url", "--json"] {
        assert!(help.stdout.contains(flag), "{help:?}");
        assert!(guide.contains(&format!("`{flag}")), "{flag}");
    }
}

/// The second runbook: a default-mode handler that ran `COMMIT` on the
/// layer's transaction and answered `201` (the test app's `commit_201`),
/// under the guide's principal, operation and key. `show`'s output is the
/// guide's, line for line (times aside); the guide's `resolve` settles it,
/// and the client's retry replays the recorded answer.
async fn the_transaction_ended_runbook_runs_as_written<DB: Store>() {
    use tower_idempotency::testkit::{Harness, order, send};
    let h = Harness::<DB>::new().await;
    let url = DB::url_of(&h.pool);
    let dir = std::env::temp_dir().join(format!(
        "ti-operating-ended-{}-{}",
        DB::LABEL,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let guide = commands(&section(&read("docs/operating.md"), RUNBOOKS[1]));
    assert_eq!(guide.len(), 2, "the two commands run below: {guide:?}");

    let app = h.app();
    let first = send(
        &app,
        order(
            Some("alice"),
            Some("k-1"),
            r#"{"amount":1,"mode":"commit_201"}"#,
        ),
    )
    .await;
    assert_eq!(first.status, 500, "{first:?}");
    assert_eq!(first.problem(), "transaction-ended", "{first:?}");

    let show = &guide[0];
    let ran = sh(&show.command, &dir, &url).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let got: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(got.len(), show.output.len(), "{ran:?} against {show:?}");
    for (got, shown) in got.iter().zip(&show.output) {
        // Times differ from run to run; their labels may not.
        let label = |l: &str| l.split(':').next().unwrap_or_default().to_string();
        if ["created", "expires"].contains(&label(shown).as_str()) {
            assert_eq!(label(got), label(shown), "{ran:?}");
        } else {
            assert_eq!(*got, shown.as_str(), "as the guide shows it: {ran:?}");
        }
    }

    let resolve = &guide[1];
    assert!(
        resolve.command.starts_with("tower-idempotency resolve "),
        "{resolve:?}"
    );
    let answer = r#"{"orderId":1,"principal":"alice","amount":1}"#;
    std::fs::write(dir.join("order.json"), answer).unwrap();
    let done = sh(&resolve.command, &dir, &url).await;
    assert_eq!(done.code, 0, "{done:?}");
    assert!(
        done.stdout
            .contains("NEEDS_RECONCILIATION (generation 0) -> SUCCEEDED 201, by alice"),
        "{done:?}"
    );
    let retry = send(
        &app,
        order(
            Some("alice"),
            Some("k-1"),
            r#"{"amount":1,"mode":"commit_201"}"#,
        ),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(&retry.body[..], answer.as_bytes(), "{retry:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
