//! The console's pages: plain HTML with a little CSS, rendered on the
//! server. Every value that comes from the ledger goes through [`esc`].

use std::fmt::Write as _;

use super::{Attribution, AuditEntry, LedgerRow, MAX_ACTOR_LEN, Resolved, human_age, step_key};
use crate::store::UnresolvedRecord;

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Encodes a query-string component.
fn url(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The console's own paths, under the prefix it is nested at (`""` when
/// it is not nested).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Base<'a>(pub(crate) &'a str);

impl Base<'_> {
    /// The list page.
    fn home(&self) -> String {
        if self.0.is_empty() {
            "/".to_string()
        } else {
            esc(self.0)
        }
    }

    /// A route under the console.
    fn path(&self, route: &str) -> String {
        format!("{}/{route}", esc(self.0))
    }
}

fn page(base: Base<'_>, title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{}</title><style>{STYLE}</style></head><body>\
         <header><a href=\"{}\">Idempotency ledger</a></header><main>{body}</main></body></html>\n",
        esc(title),
        base.home()
    )
}

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}\
header{background:#1b1f24;padding:10px 24px}header a{color:#fff;font-weight:600;text-decoration:none}\
main{padding:16px 24px;max-width:1200px}h1{font-size:20px;margin:8px 0 16px}h2{font-size:16px;margin:24px 0 8px}\
table{border-collapse:collapse;background:#fff;width:100%}th,td{border:1px solid #d8dce1;padding:6px 8px;text-align:left;vertical-align:top}\
th{background:#eef0f3;font-weight:600}code{font:12px ui-monospace,monospace;word-break:break-all}\
.parked{color:#a4161a;font-weight:600}.ok{color:#1a7f37;font-weight:600}.box{background:#fff;border:1px solid #d8dce1;padding:12px 16px}\
form label{display:block;margin:10px 0 4px;font-weight:600}input[type=text],input[type=number],textarea{width:100%;max-width:640px;padding:6px;font:inherit;box-sizing:border-box}\
textarea{min-height:70px}button{display:block;margin-top:12px;padding:8px 16px;font:inherit;font-weight:600;background:#0b5cad;color:#fff;border:0;border-radius:4px;cursor:pointer}\
.note{color:#57606a}";

fn record_href(base: Base<'_>, principal: &str, operation: &str, key: &str) -> String {
    format!(
        "{}?principal={}&amp;operation={}&amp;key={}",
        base.path("record"),
        url(principal),
        url(operation),
        url(key)
    )
}

fn opt(v: Option<&str>) -> String {
    v.map_or_else(|| "–".to_string(), esc)
}

/// The list of unresolved records.
pub(crate) fn list(base: Base<'_>, records: &[UnresolvedRecord], now: i64) -> String {
    let mut body = format!(
        "<h1>Unresolved records <span class=\"note\">({} listed, oldest first)</span></h1>",
        records.len()
    );
    if records.is_empty() {
        body.push_str("<p class=\"ok\">Nothing unresolved.</p>");
        return page(base, "Unresolved records", &body);
    }
    body.push_str(
        "<table id=\"unresolved\"><thead><tr><th>Principal</th><th>Operation</th><th>Key</th>\
         <th>Status</th><th>Age</th><th>Pending step</th><th>Step key</th><th>Recovery point</th>\
         <th>Generation</th></tr></thead><tbody>",
    );
    for r in records {
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td><a href=\"{}\">{}</a></td><td class=\"parked\">{}</td>\
             <td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
            esc(&r.principal),
            esc(&r.operation),
            record_href(base, &r.principal, &r.operation, &r.key),
            esc(&r.key),
            esc(r.status.as_str()),
            esc(&human_age(now.saturating_sub(r.created_at))),
            opt(r.pending_step.as_deref()),
            step_key(r).map_or_else(|| "–".to_string(), |k| esc(k.as_str())),
            opt(r.recovery_point.as_deref()),
            r.generation,
        );
    }
    body.push_str("</tbody></table>");
    page(base, "Unresolved records", &body)
}

fn fields(row: &LedgerRow) -> String {
    let mut t = String::from("<table class=\"fields\"><tbody>");
    let mut field = |name: &str, value: String| {
        let _ = write!(t, "<tr><th>{}</th><td>{value}</td></tr>", esc(name));
    };
    field("Principal", esc(&row.principal));
    field("Operation", esc(&row.operation));
    field("Key", esc(&row.key));
    field(
        "Status",
        format!("<span id=\"status\">{}</span>", esc(row.status.as_str())),
    );
    field("Age", esc(&human_age(row.age_ms())));
    if row.generation > 0 {
        field("Generation", row.generation.to_string());
        field("Pending step", opt(row.pending_step.as_deref()));
        let key = row.as_unresolved().as_ref().and_then(step_key);
        field(
            "Step key",
            key.map_or_else(
                || "–".to_string(),
                |k| format!("<code>{}</code>", esc(k.as_str())),
            ),
        );
        field("Recovery point", opt(row.recovery_point.as_deref()));
    }
    field("Parks", row.parks.to_string());
    if let Some(status) = row.answer_status() {
        field("Answer status", status.to_string());
    }
    if let Some(status) = row.handler_status() {
        field(
            "Handler status",
            format!(
                "{status} <span class=\"note\">(the handler's, never sent: it ended its \
                 transaction itself; the layer answered 500)</span>"
            ),
        );
    }
    for (name, value) in row.headers() {
        field("Answer header", esc(&format!("{name}: {value}")));
    }
    match (row.body_text(), &row.response_body) {
        (Some(text), _) => field("Answer body", format!("<code>{}</code>", esc(text))),
        (None, Some(bytes)) => field("Answer body", format!("{} bytes, not text", bytes.len())),
        (None, None) => {}
    }
    t.push_str("</tbody></table>");
    t
}

fn trail(entries: &[AuditEntry]) -> String {
    if entries.is_empty() {
        return "<p class=\"note\">No verdict recorded.</p>".into();
    }
    let mut t = String::from(
        "<table id=\"audit\"><thead><tr><th>#</th><th>Verdict</th><th>Answer</th><th>By</th>\
         <th>Reason</th><th>Before</th></tr></thead><tbody>",
    );
    for e in entries {
        let before = serde_json::from_str::<serde_json::Value>(&e.before)
            .ok()
            .and_then(|b| b["status"].as_str().map(str::to_string))
            .unwrap_or_default();
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            e.id,
            esc(&e.verdict),
            e.response_status
                .map_or_else(|| "–".into(), |s| s.to_string()),
            esc(&e.actor),
            esc(&e.reason),
            esc(&before),
        );
    }
    t.push_str("</tbody></table>");
    t
}

/// One record, its audit trail, and (when unsettled) the form that settles
/// it. `actor`: the operator the authentication layer named; without one
/// the form asks who resolves.
pub(crate) fn record(
    base: Base<'_>,
    row: &LedgerRow,
    entries: &[AuditEntry],
    actor: Option<&str>,
) -> String {
    let mut body = format!("<h1>Record <code>{}</code></h1>", esc(&row.key));
    body.push_str(&fields(row));
    body.push_str("<h2>Audit trail</h2>");
    body.push_str(&trail(entries));
    if let Some(r) = row.as_unresolved() {
        let hidden = |name: &str, value: &str| {
            format!(
                "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
                esc(name),
                esc(value)
            )
        };
        let who = match actor {
            Some(a) => format!(
                "<p class=\"note\">Recorded as <strong>{}</strong>.</p>",
                esc(a)
            ),
            None => format!(
                "<label for=\"actor\">Your name (recorded in the audit trail)</label>\
                 <input type=\"text\" id=\"actor\" name=\"actor\" required maxlength=\"{MAX_ACTOR_LEN}\">"
            ),
        };
        let _ = write!(
            body,
            "<h2>Settle it</h2><form class=\"box\" method=\"post\" action=\"{}\">{}{}{}{}{}{}\
             <p class=\"note\">Check the provider with the step key first. The verdict applies to the \
             record as shown here: if it changes meanwhile, the verdict is refused.</p>\
             <label><input type=\"radio\" name=\"verdict\" id=\"verdict-succeeded\" value=\"succeeded\" \
             required> Succeeded: retries replay this answer</label>\
             <label><input type=\"radio\" name=\"verdict\" id=\"verdict-failed\" value=\"failed\"> \
             Failed for good: retries replay this answer</label>\
             <label><input type=\"radio\" name=\"verdict\" id=\"verdict-rerun\" value=\"rerun\"> \
             Nothing took effect: the next retry runs it again</label>\
             <label for=\"answer-status\">Answer status (succeeded or failed)</label>\
             <input type=\"number\" id=\"answer-status\" name=\"status\" min=\"200\" max=\"599\">\
             <label for=\"content_type\">Answer content type</label><input type=\"text\" \
             id=\"content_type\" name=\"content_type\" value=\"application/json\">\
             <label for=\"body\">Answer body (succeeded or failed)</label>\
             <textarea id=\"body\" name=\"body\"></textarea>\
             <label for=\"reason\">Reason (recorded in the audit trail)</label>\
             <textarea id=\"reason\" name=\"reason\" required></textarea>{}\
             <button type=\"submit\" id=\"resolve\">Record the verdict</button></form>",
            base.path("resolve"),
            hidden("principal", &r.principal),
            hidden("operation", &r.operation),
            hidden("key", &r.key),
            hidden("generation", &r.generation.to_string()),
            hidden("claim_id", r.claim_id.as_deref().unwrap_or("")),
            hidden("parks", &r.parks.to_string()),
            who,
        );
    }
    page(base, "Record", &body)
}

/// The confirmation of a recorded verdict.
pub(crate) fn resolved(base: Base<'_>, done: &Resolved, by: &Attribution) -> String {
    let now = match &done.after {
        Some(a) => match a.response_status {
            Some(s) => format!("{} {s}", a.status.as_str()),
            None => format!(
                "{} (its lease ended: the next retry resumes it)",
                a.status.as_str()
            ),
        },
        None => "deleted: the key's next request runs afresh".to_string(),
    };
    let b = &done.before;
    let body = format!(
        "<h1 class=\"ok\" id=\"confirmation\">Verdict recorded</h1><div class=\"box\">\
         <p><code>{}</code> / <code>{}</code> / <code>{}</code></p>\
         <p>Was <strong>{}</strong> (generation {}), is now <strong id=\"now\">{}</strong>.</p>\
         <p>Recorded by <strong>{}</strong>: {}</p></div>\
         <p><a href=\"{}\">Back to the record</a> · <a href=\"{}\">All unresolved records</a></p>",
        esc(&b.principal),
        esc(&b.operation),
        esc(&b.key),
        esc(b.status.as_str()),
        b.generation,
        esc(&now),
        esc(by.actor()),
        esc(by.reason()),
        record_href(base, &b.principal, &b.operation, &b.key),
        base.home(),
    );
    page(base, "Verdict recorded", &body)
}

/// A refusal page.
pub(crate) fn refused(
    base: Base<'_>,
    kind: &str,
    message: &str,
    row: Option<&LedgerRow>,
) -> String {
    let mut body = format!(
        "<h1 class=\"parked\" id=\"refused\">Refused ({})</h1><p>{}</p>",
        esc(kind),
        esc(message)
    );
    if let Some(row) = row {
        body.push_str("<h2>The record now</h2>");
        body.push_str(&fields(row));
    }
    let _ = write!(
        body,
        "<p><a href=\"{}\">All unresolved records</a></p>",
        base.home()
    );
    page(base, "Refused", &body)
}

#[cfg(test)]
mod tests {
    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            super::esc(r#"<script>alert("x")</script>&'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;"
        );
        assert_eq!(super::url("POST /a&b=c"), "POST%20%2Fa%26b%3Dc");
    }
}
