//! The hyper-only example as a real process: the layer stacked with
//! `tower::ServiceBuilder` on plain hyper 1 guards `POST /orders`.

mod common;

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn the_hyper_example_replays_and_refuses_a_changed_payload() {
    let bin = common::example("hyper_server");
    let dir = std::env::temp_dir().join(format!("hyper-server-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(bin)
        .args(["--addr", "127.0.0.1:0"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let addr = common::address(&line);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let order = |amount: u32| {
        http::Request::post(format!("http://{addr}/orders"))
            .header("authorization", "Bearer user-42")
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(r#"{{"amount":{amount}}}"#))))
            .unwrap()
    };
    let mut answers = Vec::new();
    for amount in [1000, 1000, 1001] {
        let res = tokio::time::timeout(Duration::from_secs(10), client.request(order(amount)))
            .await
            .unwrap()
            .unwrap();
        let (parts, body) = res.into_parts();
        answers.push((parts, body.collect().await.unwrap().to_bytes()));
    }
    assert_eq!(answers[0].0.status, 201);
    assert_eq!(answers[1].0.status, 201);
    assert_eq!(answers[1].0.headers["idempotent-replayed"], "true");
    assert_eq!(answers[0].1, answers[1].1, "replayed byte for byte");
    assert_eq!(answers[2].0.status, 422, "a changed payload under the key");
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}
