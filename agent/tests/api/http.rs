//! HTTP: 200 decisions, 429 with Retry-After, Cache-Control and the policy body, 400 JSON
//! errors naming the problem with nothing spent, health, status and metrics — through the axum
//! router and over loopback.

use crate::support::*;
use allot_agent::api::http::router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::io::{Read, Write};
use tower::ServiceExt;

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
    text: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

async fn send(r: &Rig, method: &str, path: &str, body: &str) -> Answer {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = router(r.decider.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).to_string();
    Answer {
        status,
        headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        text,
    }
}

fn check_body(client: &str) -> String {
    json!({"domain": "edge", "descriptors": [{"entries": [{"key": "client", "value": client}]}]})
        .to_string()
}

#[tokio::test]
async fn check_answers_200_then_429_with_headers_and_policy_body() {
    let r = rig(LOCAL);
    for left in ["2", "1", "0"] {
        let a = send(&r, "POST", "/v1/check", &check_body("h")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        assert_eq!(a.body["code"], "OK");
        assert_eq!(a.body["policy"], "per-client");
        assert_eq!(a.body["policy_version"], 1);
        assert_eq!(a.body["remaining"].to_string(), left);
        assert_eq!(a.body["descriptors"][0]["reason"], "within_limit");
        assert_eq!(a.header("ratelimit-limit"), Some("3"));
        assert_eq!(a.header("ratelimit-remaining"), Some(left));
        assert!(a.header("retry-after").is_none());
    }
    let a = send(&r, "POST", "/v1/check", &check_body("h")).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.header("retry-after"), Some("20"));
    assert_eq!(a.header("cache-control"), Some("no-store"));
    assert_eq!(a.header("ratelimit-limit"), Some("3"));
    assert_eq!(a.header("ratelimit-remaining"), Some("0"));
    assert_eq!(a.header("ratelimit-reset"), Some("60"));
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(
        a.body,
        json!({"error": "rate_limit_exceeded", "policy": "per-client-v1"})
    );
}

#[tokio::test]
async fn bad_input_is_400_json_naming_the_problem_and_spends_nothing() {
    let r = rig(LOCAL);
    let tokens = |cost: &str| {
        format!(
            r#"{{"domain":"edge","descriptors":[{{"entries":[{{"key":"tokens","value":"t"}}]}}],"cost":{cost}}}"#
        )
    };
    let cases = [
        ("{not json".to_string(), "malformed JSON body"),
        (
            r#"{"descriptors":[]}"#.to_string(),
            "missing field `domain`",
        ),
        (
            r#"{"domain":"edge","descriptors":[]}"#.to_string(),
            "request has no descriptors",
        ),
        (
            r#"{"domain":"edge","descriptors":[{"entries":[{"key":"k","value":"v"}]}],"extra":1}"#
                .to_string(),
            "unknown field `extra`",
        ),
        (
            r#"{"domain":"nope","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#
                .to_string(),
            "unknown domain \"nope\"",
        ),
        (
            r#"{"domain":"edge","descriptors":[{"entries":[{"key":"","value":"v"}]}]}"#.to_string(),
            "descriptors[0].entries[0].key is empty",
        ),
        (tokens("4294967296"), "cost is 4294967296"),
        (tokens("-1"), "invalid value: integer `-1`"),
    ];
    for (body, msg) in cases {
        let a = send(&r, "POST", "/v1/check", &body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text);
        assert_eq!(a.body["error"], "invalid_argument", "{}", a.text);
        let m = a.body["message"].as_str().unwrap_or_default();
        assert!(m.contains(msg), "{m:?} does not name {msg:?}");
    }
    // A cost above the capacity is a 429 that can never pass, not a 400 a gateway might let
    // through: reason "never" and no Retry-After (issue 10 item 16).
    let a = send(&r, "POST", "/v1/check", &tokens("101")).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.text);
    assert_eq!(
        a.body,
        json!({"error": "rate_limit_exceeded", "policy": "llm-tokens-v1", "reason": "never"})
    );
    assert_eq!(a.header("retry-after"), None);
    let a = send(
        &r,
        "POST",
        "/v1/check",
        r#"{"domain":"edge","descriptors":[{"entries":[{"key":"tokens","value":"t"}],"hits_addend":0}]}"#,
    )
    .await;
    assert_eq!(a.body["remaining"], 100, "nothing was spent: {}", a.text);
}

#[tokio::test]
async fn unknown_paths_and_methods_are_json_errors_and_spend_nothing() {
    let r = rig(LOCAL);
    let a = send(&r, "POST", "/v1/chek", &check_body("m")).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(a.body["error"], "not_found");
    assert_eq!(a.body["message"], "no such path: /v1/chek");

    let a = send(&r, "GET", "/v1/check", "").await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{}", a.text);
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(a.header("allow"), Some("POST"));
    assert_eq!(a.body["error"], "method_not_allowed");
    assert_eq!(a.body["message"], "GET is not served on /v1/check");

    let a = send(&r, "POST", "/healthz", "").await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{}", a.text);
    assert_eq!(a.body["error"], "method_not_allowed");

    // Nothing was spent by them: the key still has its whole limit (3).
    let a = send(&r, "POST", "/v1/check", &check_body("m")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.body["remaining"].to_string(), "2");
}

#[tokio::test]
async fn reserve_settle_and_done_over_http() {
    let r = rig(LOCAL);
    let a = send(
        &r,
        "POST",
        "/v1/reserve",
        r#"{"domain":"edge","descriptors":[{"entries":[{"key":"tokens","value":"t"}]}],"max_cost":10,"request_id":"h1"}"#,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(
        (
            a.body["reservation_id"].as_str(),
            a.body["remaining"].as_u64()
        ),
        (Some("h1"), Some(90))
    );
    for already in [false, true] {
        let a = send(
            &r,
            "POST",
            "/v1/settle",
            r#"{"reservation_id":"h1","actual_cost":4}"#,
        )
        .await;
        assert_eq!(
            a.body,
            json!({"refunded": 6, "actual_cost": 4, "already_settled": already})
        );
    }
    let a = send(
        &r,
        "POST",
        "/v1/settle",
        r#"{"reservation_id":"zz","actual_cost":4}"#,
    )
    .await;
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let slow = r#"{"domain":"edge","descriptors":[{"entries":[{"key":"path","value":"/slow"}]}],"request_id":"s1"}"#;
    assert_eq!(
        send(&r, "POST", "/v1/check", slow).await.status,
        StatusCode::OK
    );
    let a = send(&r, "POST", "/v1/done", r#"{"request_id":"s1"}"#).await;
    assert_eq!(a.body, json!({"released_slots": 1}));
}

#[tokio::test]
async fn health_status_and_metrics() {
    let r = rig(LOCAL);
    assert_eq!(
        send(&r, "GET", "/healthz", "").await.body,
        json!({"status": "ok"})
    );
    for _ in 0..4 {
        send(&r, "POST", "/v1/check", &check_body("m")).await;
    }
    send(
        &r,
        "POST",
        "/v1/check",
        r#"{"domain":"edge","descriptors":[{"entries":[{"key":"shadow","value":"s"}]}]}"#,
    )
    .await;
    send(
        &r,
        "POST",
        "/v1/check",
        r#"{"domain":"edge","descriptors":[{"entries":[{"key":"shadow","value":"s"}]}]}"#,
    )
    .await;
    send(&r, "POST", "/v1/check", "{").await;
    let a = send(&r, "GET", "/v1/status", "").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["agent_id"], "gw-1");
    assert_eq!(a.body["overshoot_bound_micros"], 0);
    assert_eq!(a.body["allocator_reachable"], true);
    assert_eq!(a.body["keys"], json!([]));
    let m = send(&r, "GET", "/metrics", "").await;
    assert_eq!(m.status, StatusCode::OK);
    let has = |name: &str, labels: &[&str], value: &str| {
        m.text.lines().any(|l| {
            l.starts_with(name)
                && labels.iter().all(|x| l.contains(x))
                && l.ends_with(&format!(" {value}"))
        })
    };
    assert!(
        has(
            "allot_agent_policy_decisions_total",
            &["policy=\"per-client\"", "outcome=\"allowed\""],
            "3"
        ),
        "{}",
        m.text
    );
    assert!(
        has(
            "allot_agent_policy_decisions_total",
            &["policy=\"per-client\"", "outcome=\"denied\""],
            "1"
        ),
        "{}",
        m.text
    );
    assert!(
        has(
            "allot_agent_policy_decisions_total",
            &["policy=\"shadowed\"", "outcome=\"shadow_denied\""],
            "1"
        ),
        "{}",
        m.text
    );
    assert!(
        has("allot_agent_requests_total", &["code=\"invalid\""], "1"),
        "{}",
        m.text
    );
    assert!(
        has("allot_agent_requests_total", &["code=\"over_limit\""], "1"),
        "{}",
        m.text
    );
    assert!(
        has("allot_agent_overshoot_bound_tokens", &[], "0"),
        "{}",
        m.text
    );
    assert!(has("allot_agent_allocations_held", &[], "0"), "{}", m.text);
    assert!(has("allot_agent_lease_keys", &[], "0"), "{}", m.text);
    assert!(
        m.text
            .contains("allot_agent_decision_latency_seconds_bucket"),
        "{}",
        m.text
    );
    assert!(
        m.text.contains("allot_agent_allocator_rpcs_total"),
        "{}",
        m.text
    );
    assert!(
        m.text.contains("allot_agent_cold_waits_total"),
        "{}",
        m.text
    );
    assert!(
        m.text.contains("allot_agent_lease_wait_timeouts_total"),
        "{}",
        m.text
    );
}

/// A raw HTTP/1.1 exchange over loopback (the status line, headers and body as text).
fn raw_http(addr: std::net::SocketAddr, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_loopback_http() {
    let r = rig(LOCAL);
    let servers = Servers::start(r.decider.clone()).await;
    let body = check_body("net");
    let req = format!(
        "POST /v1/check HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let addr = servers.http;
    for _ in 0..3 {
        let req = req.clone();
        let out = tokio::task::spawn_blocking(move || raw_http(addr, &req))
            .await
            .unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
    let out = tokio::task::spawn_blocking(move || raw_http(addr, &req))
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 429"), "{out}");
    let lower = out.to_ascii_lowercase();
    assert!(lower.contains("\r\nretry-after: 20\r\n"), "{out}");
    assert!(lower.contains("\r\ncache-control: no-store\r\n"), "{out}");
    assert!(
        out.ends_with(r#"{"error":"rate_limit_exceeded","policy":"per-client-v1"}"#),
        "{out}"
    );
}
