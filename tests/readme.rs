//! The README's commands, run as written against the example service
//! (`curl`, the shell): the walk-through and the key-status look-up, judged
//! by the answers the README's comments promise.

mod common;

/// Every shell command of the README that talks to the example service on
/// `localhost:3000`, continuation lines joined, in order.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("the README");
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut current = String::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_sh = line == "```sh";
            continue;
        }
        if !in_sh || line.trim_start().starts_with('#') || line.trim().is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                if current.contains("localhost:3000") {
                    commands.push(std::mem::take(&mut current));
                }
                current.clear();
            }
        }
    }
    commands
}

/// The status code of a `curl -si` answer.
fn status(out: &str) -> u16 {
    out.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_commands_answer_as_it_says() {
    let dir = std::env::temp_dir().join(format!(
        "ti-readme-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite:{}", dir.join("orders.db").display());
    let (_child, addr) = common::order_service(&url, 0, &[]).await;
    let commands = readme_commands();
    assert!(commands.len() >= 8, "{commands:#?}");
    let mut outputs = Vec::new();
    for command in &commands {
        let command = command.replace("localhost:3000", &addr);
        let out = tokio::process::Command::new("sh")
            .args(["-c", &command])
            .output()
            .await
            .expect("sh and curl");
        assert!(out.status.success(), "{command}: {out:?}");
        outputs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let answers: Vec<&String> = outputs.iter().filter(|o| o.starts_with("HTTP/")).collect();
    let codes: Vec<u16> = answers.iter().map(|o| status(o)).collect();
    // Create, replay, key reused, out of stock, another principal.
    assert_eq!(codes, [201, 201, 422, 409, 201], "{outputs:#?}");
    assert!(
        answers[1]
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{}",
        answers[1]
    );
    let body = |o: &str| o.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    assert_eq!(body(answers[0]), body(answers[1]), "byte for byte");
    assert!(answers[2].contains("#key-reused"), "{}", answers[2]);
    assert!(answers[3].contains("out-of-stock"), "{}", answers[3]);
    // "Stock is still 3" after the replay.
    assert!(
        outputs.iter().any(|o| o.contains("\"qty\":3")),
        "{outputs:#?}"
    );
    // The key-status look-up: the first key landed.
    assert!(
        outputs
            .iter()
            .any(|o| o.contains("\"status\":\"succeeded\"") && o.contains("create-order")),
        "{outputs:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
