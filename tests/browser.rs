//! The console in a real browser: headless Chromium driven through
//! chromedriver's WebDriver HTTP API. `examples/payment_service` (with the
//! console at `/admin`) parks a payment whose charge answer was lost while
//! `examples/fake_provider`'s look-up is down; the operator finds it in the
//! list, opens it, settles it through the form with the provider's charge
//! id, sees the confirmation, and the client's retry replays the operator's
//! answer.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs
//! them when missing), PostgreSQL, and the two examples built (a plain
//! `cargo test --all-features` builds them; `--test browser` alone does
//! not: `cargo build --all-features --example payment_service --example
//! fake_provider` first). The record page's screenshot is written to
//! `$CARGO_TARGET_TMPDIR/admin-console.png`, and also to the path in
//! `SCREENSHOT_TO` when set (the README's is `docs/admin-console.png`).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tower_idempotency::testkit::ConformanceDb;

const CALL: Duration = Duration::from_secs(30);
const START: Duration = Duration::from_secs(30);
const TOKEN: &str = "console-test-token";
const PAYMENT: &str = r#"{"orderId":"o-2001","amount":12000,"currency":"KRW","source":"tok_visa"}"#;
const KEY: &str = "pay-browser-001";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// WebDriver's name for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// One HTTP/1.1 request to `addr` (HOST:PORT), bounded by [`CALL`].
async fn http(
    addr: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let call = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr);
        if !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        {
            req = req.header("content-type", "application/json");
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = res.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok::<_, String>(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    match tokio::time::timeout(CALL, call).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => panic!("{path}: {e}"),
        Err(_) => panic!("{path}: no answer within {CALL:?}"),
    }
}

/// A chromedriver process and one headless Chromium session.
struct Browser {
    addr: String,
    session: String,
    profile: std::path::PathBuf,
    _driver: Child,
}

impl Browser {
    async fn start() -> Self {
        for bin in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                std::path::Path::new(bin).exists(),
                "{bin} is missing: apt-get install -y --no-install-recommends chromium chromium-driver (.ci/run does)"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let addr = format!("127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            if let Ok(Ok(_)) = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::net::TcpStream::connect(&addr),
            )
            .await
            {
                let status = http(&addr, Method::GET, "/status", &[], "").await;
                if status.json()["value"]["ready"] == true {
                    break;
                }
            }
            assert!(
                start.elapsed() < START,
                "chromedriver is ready within {START:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = std::env::temp_dir().join(format!(
            "ti-chromium-{}-{}",
            std::process::id(),
            start.elapsed().as_nanos()
        ));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    format!("--user-data-dir={}", profile.display()),
                    "--window-size=1280,1400",
                ],
            },
        }}});
        let created = http(&addr, Method::POST, "/session", &[], &caps.to_string()).await;
        assert_eq!(created.status, StatusCode::OK, "{created:?}");
        let session = created.json()["value"]["sessionId"]
            .as_str()
            .expect("a session id")
            .to_string();
        let browser = Self {
            addr,
            session,
            profile,
            _driver: driver,
        };
        browser
            .call(
                Method::POST,
                "timeouts",
                json!({"implicit": 5000, "pageLoad": 30000}),
            )
            .await;
        browser
    }

    /// A WebDriver command on the session; its `value`.
    async fn call(&self, method: Method, path: &str, body: Value) -> Value {
        let path = format!("/session/{}/{path}", self.session);
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        let a = http(&self.addr, method, &path, &[], &body).await;
        assert_eq!(
            a.status,
            StatusCode::OK,
            "{path}: {}",
            String::from_utf8_lossy(&a.body)
        );
        a.json()["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.call(Method::POST, "url", json!({ "url": url })).await;
    }

    async fn url(&self) -> String {
        self.call(Method::GET, "url", Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Waits (10 s at most) until the page's URL ends with `suffix`: a
    /// form's submission navigates after the click returns.
    async fn wait_for_url(&self, suffix: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let url = self.url().await;
            if url.ends_with(suffix) {
                return;
            }
            assert!(Instant::now() < deadline, "{url} never ended with {suffix}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn source(&self) -> String {
        self.call(Method::GET, "source", Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The element `css` selects (waiting up to the implicit wait).
    async fn find(&self, css: &str) -> String {
        let v = self
            .call(
                Method::POST,
                "element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no {css}: {v}"))
            .to_string()
    }

    async fn text(&self, css: &str) -> String {
        let e = self.find(css).await;
        let v = self
            .call(Method::GET, &format!("element/{e}/text"), Value::Null)
            .await;
        v.as_str().unwrap_or_default().to_string()
    }

    async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.call(Method::POST, &format!("element/{e}/click"), json!({}))
            .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.call(Method::POST, &format!("element/{e}/clear"), json!({}))
            .await;
        self.call(
            Method::POST,
            &format!("element/{e}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    async fn screenshot(&self) -> Vec<u8> {
        let v = self.call(Method::GET, "screenshot", Value::Null).await;
        base64_decode(v.as_str().expect("a base64 PNG"))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Best effort, also when a test fails half-way: end the session
        // (chromedriver closes the browser), then chromedriver is killed
        // with its handle (kill_on_drop), and the profile goes.
        use std::io::{Read, Write};
        if let Ok(mut conn) = std::net::TcpStream::connect(&self.addr) {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let req = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                self.session, self.addr
            );
            if conn.write_all(req.as_bytes()).is_ok() {
                let _ = conn.read_to_end(&mut Vec::new());
            }
        }
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let clean: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

#[test]
fn base64_decodes() {
    assert_eq!(base64_decode("aGVsbG8="), b"hello");
    assert_eq!(base64_decode("aGk="), b"hi");
    assert_eq!(base64_decode("YWJj"), b"abc");
}

/// The example's console login: the token is posted once, the cookie holds
/// a random session id (never the token), the token in a URL logs no one
/// in, and a session ends at logout or when it expires.
#[tokio::test(flavor = "multi_thread")]
async fn the_console_login_keeps_the_token_out_of_cookies_and_urls() {
    let (url, _drop) = sqlx::Postgres::fresh_url().await;
    let (_service, service) = common::start_example(
        "payment_service",
        &[
            "--addr",
            "127.0.0.1:0",
            "--provider",
            "http://127.0.0.1:9",
            "--completer-interval-ms",
            "600000",
        ],
        &[
            ("DATABASE_URL", &url),
            ("ADMIN_TOKEN", TOKEN),
            ("ADMIN_SESSION_SECS", "3"),
        ],
    )
    .await;
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let cookie_of = |a: &Answer| -> Option<String> {
        let set = a.headers.get("set-cookie")?.to_str().ok()?;
        Some(set.split(';').next()?.to_string())
    };
    // The token in a URL is ignored: a form, no cookie.
    let by_url = http(
        &service,
        Method::GET,
        &format!("/admin/login?token={TOKEN}"),
        &[],
        "",
    )
    .await;
    assert_eq!(by_url.status, StatusCode::OK, "{by_url:?}");
    assert!(by_url.headers.get("set-cookie").is_none(), "{by_url:?}");
    assert!(String::from_utf8_lossy(&by_url.body).contains("type=\"password\""));
    let wrong = http(&service, Method::POST, "/admin/login", &form, "token=nope").await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{wrong:?}");
    assert!(wrong.headers.get("set-cookie").is_none());

    let login = http(
        &service,
        Method::POST,
        "/admin/login",
        &form,
        &format!("token={TOKEN}"),
    )
    .await;
    assert_eq!(login.status, StatusCode::SEE_OTHER, "{login:?}");
    let set = login.headers["set-cookie"].to_str().unwrap().to_string();
    assert!(!set.contains(TOKEN), "the token never in a cookie: {set}");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/admin", "Max-Age=3"] {
        assert!(set.contains(attr), "{attr} in {set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: {set}");
    let session = cookie_of(&login).unwrap();
    let id = session.strip_prefix("admin_session=").unwrap();
    assert_eq!(id.len(), 32, "128 random bits: {id}");
    let again = http(
        &service,
        Method::POST,
        "/admin/login",
        &form,
        &format!("token={TOKEN}"),
    )
    .await;
    assert_ne!(
        cookie_of(&again),
        Some(session.clone()),
        "a new id per login"
    );
    let behind_tls = http(
        &service,
        Method::POST,
        "/admin/login",
        &[form[0], ("x-forwarded-proto", "https")],
        &format!("token={TOKEN}"),
    )
    .await;
    assert!(
        behind_tls.headers["set-cookie"]
            .to_str()
            .unwrap()
            .contains("; Secure")
    );

    let with = |c: &str| {
        let c = c.to_string();
        let service = service.clone();
        async move {
            http(&service, Method::GET, "/admin", &[("cookie", &c)], "")
                .await
                .status
        }
    };
    assert_eq!(with(&session).await, StatusCode::OK);
    assert_eq!(
        with(&format!("admin_session={TOKEN}")).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        with(&format!("admin_token={TOKEN}")).await,
        StatusCode::UNAUTHORIZED
    );
    // Logout ends the session at once.
    let other = cookie_of(&again).unwrap();
    assert_eq!(with(&other).await, StatusCode::OK);
    let out = http(
        &service,
        Method::POST,
        "/admin/logout",
        &[("cookie", &other)],
        "",
    )
    .await;
    assert_eq!(out.status, StatusCode::SEE_OTHER, "{out:?}");
    assert_eq!(with(&other).await, StatusCode::UNAUTHORIZED);
    // And a session expires.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    assert_eq!(with(&session).await, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_settles_a_parked_payment_in_the_browser_and_the_retry_replays_it() {
    let (_provider, provider) =
        common::start_example("fake_provider", &["--addr", "127.0.0.1:0"], &[]).await;
    let (url, _drop) = sqlx::Postgres::fresh_url().await;
    let provider_url = format!("http://{provider}");
    let (_service, service) = common::start_example(
        "payment_service",
        &[
            "--addr",
            "127.0.0.1:0",
            "--provider",
            &provider_url,
            "--lease-ms",
            "30000",
            "--provider-timeout-ms",
            "5000",
            // No completer pass while the operator works.
            "--completer-interval-ms",
            "600000",
        ],
        &[
            ("DATABASE_URL", &url),
            ("ADMIN_TOKEN", TOKEN),
            ("ADMIN_ACTOR", "alice"),
        ],
    )
    .await;

    // The charge is made, its answer lost, and the look-up is down: parked.
    for fault in [
        json!({"mode": "charge_then_drop"}),
        json!({"mode": "lookup_down"}),
    ] {
        let a = http(&provider, Method::POST, "/faults", &[], &fault.to_string()).await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
    }
    let pay = || async {
        let headers = [
            ("authorization", "Bearer user-42"),
            ("idempotency-key", KEY),
        ];
        http(&service, Method::POST, "/payments", &headers, PAYMENT).await
    };
    let parked = pay().await;
    assert_eq!(parked.status, StatusCode::SERVICE_UNAVAILABLE, "{parked:?}");
    assert!(
        parked.json()["type"]
            .as_str()
            .unwrap_or_default()
            .ends_with("#reconciling")
    );
    // Without the token the console is closed.
    let closed = http(&service, Method::GET, "/admin", &[], "").await;
    assert_eq!(closed.status, StatusCode::UNAUTHORIZED);
    // What the operator checks: the provider's charge.
    let charges = http(&provider, Method::GET, "/charges", &[], "")
        .await
        .json();
    let charge_id = charges[0]["chargeId"]
        .as_str()
        .expect("one charge")
        .to_string();

    let browser = Browser::start().await;
    browser.go(&format!("http://{service}/admin/login")).await;
    browser.type_into("#token", TOKEN).await;
    browser.click("#login").await;
    browser.wait_for_url("/admin").await;
    let list = browser.source().await;
    assert!(list.contains("NEEDS_RECONCILIATION"), "{list}");
    assert!(list.contains("charge"), "the pending step: {list}");
    assert_eq!(browser.text("#unresolved tbody a").await, KEY);
    browser.click("#unresolved tbody a").await;
    assert!(
        browser.url().await.contains("/admin/record?"),
        "{}",
        browser.url().await
    );
    assert_eq!(browser.text("#status").await, "NEEDS_RECONCILIATION");

    let answer =
        json!({"paymentId": "settled-by-operator", "status": "captured", "chargeId": charge_id})
            .to_string();
    // The form presets nothing: the verdict and the status are chosen.
    browser.click("#verdict-succeeded").await;
    browser.type_into("#answer-status", "201").await;
    browser.type_into("#body", &answer).await;
    browser
        .type_into(
            "#reason",
            &format!("provider shows {charge_id} for the step key"),
        )
        .await;
    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("admin-console.png"),
        &png,
    )
    .unwrap();
    if let Ok(path) = std::env::var("SCREENSHOT_TO") {
        std::fs::write(path, &png).unwrap();
    }
    browser.click("#resolve").await;
    assert_eq!(browser.text("#confirmation").await, "Verdict recorded");
    assert_eq!(browser.text("#now").await, "SUCCEEDED 201");
    assert!(
        browser.source().await.contains("alice"),
        "recorded as the console's actor"
    );

    // The client's retry replays the operator's answer; no second charge.
    let retry = pay().await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(retry.body, Bytes::from(answer));
    let charges = http(&provider, Method::GET, "/charges", &[], "")
        .await
        .json();
    assert_eq!(charges.as_array().map(Vec::len), Some(1), "{charges}");

    // The list is empty now.
    browser.go(&format!("http://{service}/admin")).await;
    assert!(browser.source().await.contains("Nothing unresolved"));
}
