//! One HTTP/1.1 request on a fresh connection, and its answer read whole.

// Each test crate that includes this module uses a part of it.
#![allow(dead_code)]

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub async fn http_call(
    addr: &str,
    method: Method,
    path: &str,
    principal: Option<&str>,
    key: Option<&str>,
    body: &str,
) -> Answer {
    try_http_call(addr, method, path, principal, key, body)
        .await
        .unwrap()
}

/// One request on a fresh connection; `Err` when the connection dies.
pub async fn try_http_call(
    addr: &str,
    method: Method,
    path: &str,
    principal: Option<&str>,
    key: Option<&str>,
    body: &str,
) -> Result<Answer, hyper::Error> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr)
        .header("content-type", "application/json");
    if let Some(p) = principal {
        req = req.header("authorization", format!("Bearer {p}"));
    }
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let res = sender
        .send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await?;
    let (parts, body) = res.into_parts();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await?.to_bytes(),
    })
}
