//! Envoy's RLS v3: codes, statuses, headers and Retry-After exact, invalid input refused with
//! nothing spent — through the service struct and over loopback.

use crate::support::*;
use allot_agent::api::rls::RlsService;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::{rate_limit::Unit, Code};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use allot_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use allot_proto::prost_types::Duration;
use prost::bytes::BufMut;
use prost::Message;
use std::sync::atomic::Ordering;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::Status;
use tonic_prost::ProstDecoder;

fn headers(r: &RateLimitResponse) -> Vec<(String, String)> {
    r.response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect()
}

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn secs(s: i64) -> Option<Duration> {
    Some(Duration {
        seconds: s,
        nanos: 0,
    })
}

async fn call(svc: &RlsService, r: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
    svc.should_rate_limit(tonic::Request::new(r))
        .await
        .map(|r| r.into_inner())
}

#[tokio::test]
async fn token_bucket_statuses_headers_and_retry_after_are_exact() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let req = || rls("edge", &[&[("client", "a")]], 0);
    for (remaining, reset) in [(2u32, 20i64), (1, 40), (0, 60)] {
        let resp = call(&svc, req()).await.unwrap();
        assert_eq!(resp.overall_code, Code::Ok as i32);
        let s = &resp.statuses[0];
        assert_eq!(s.code, Code::Ok as i32);
        let l = s.current_limit.as_ref().unwrap();
        assert_eq!(
            (l.requests_per_unit, l.unit, l.name.as_str()),
            (3, Unit::Minute as i32, "per-client")
        );
        assert_eq!(s.limit_remaining, remaining);
        assert_eq!(s.duration_until_reset, secs(reset));
        assert_eq!(
            headers(&resp),
            h(&[
                ("RateLimit-Limit", "3"),
                ("RateLimit-Remaining", &remaining.to_string()),
                ("RateLimit-Reset", &reset.to_string()),
            ])
        );
    }
    let resp = call(&svc, req()).await.unwrap();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[0].limit_remaining, 0);
    assert_eq!(resp.statuses[0].duration_until_reset, secs(60));
    assert_eq!(
        headers(&resp),
        h(&[
            ("RateLimit-Limit", "3"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "60"),
            ("retry-after", "20"),
        ])
    );
    // 10.5 s later one token is 9.5 s away: Retry-After rounds up to 10.
    r.clock.advance(10_500 * MS);
    let resp = call(&svc, req()).await.unwrap();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(
        resp.statuses[0].duration_until_reset,
        Some(Duration {
            seconds: 49,
            nanos: 500_000_000
        })
    );
    assert_eq!(
        headers(&resp).last().unwrap(),
        &("retry-after".into(), "10".into())
    );
    r.clock.advance(9_500 * MS);
    let resp = call(&svc, req()).await.unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(resp.statuses[0].limit_remaining, 0);
}

#[tokio::test]
async fn multi_descriptor_requests_are_all_or_nothing() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let both = || rls("edge", &[&[("client", "b")], &[("window", "w")]], 0);
    // The fixed window [960 s, 1020 s) admits 2; t = 1000 s, so it ends in 20 s.
    for (client, window) in [(2, 1), (1, 0)] {
        let resp = call(&svc, both()).await.unwrap();
        assert_eq!(resp.overall_code, Code::Ok as i32);
        assert_eq!(
            (
                resp.statuses[0].limit_remaining,
                resp.statuses[1].limit_remaining
            ),
            (client, window)
        );
    }
    let resp = call(&svc, both()).await.unwrap();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[0].code, Code::Ok as i32);
    assert_eq!(
        resp.statuses[0].limit_remaining, 1,
        "the denied request spent nothing"
    );
    assert_eq!(resp.statuses[1].code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[1].duration_until_reset, secs(20));
    let hs = headers(&resp);
    assert!(
        hs.contains(&("RateLimit-Limit".into(), "2".into())),
        "{hs:?}"
    );
    assert!(
        hs.contains(&("RateLimit-Reset".into(), "20".into())),
        "{hs:?}"
    );
    assert_eq!(hs.last().unwrap(), &("retry-after".into(), "20".into()));
    // The client bucket still holds its token.
    let resp = call(&svc, rls("edge", &[&[("client", "b")]], 0))
        .await
        .unwrap();
    assert_eq!(
        (resp.overall_code, resp.statuses[0].limit_remaining),
        (Code::Ok as i32, 0)
    );
}

#[tokio::test]
async fn shadow_unlimited_and_unmatched_descriptors() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let resp = call(&svc, rls("edge", &[&[("shadow", "x")]], 0))
        .await
        .unwrap();
    assert_eq!(
        (resp.overall_code, resp.statuses[0].limit_remaining),
        (Code::Ok as i32, 0)
    );
    // The would-be denial answers OK, with no Retry-After.
    let resp = call(&svc, rls("edge", &[&[("shadow", "x")]], 0))
        .await
        .unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(resp.statuses[0].code, Code::Ok as i32);
    assert!(headers(&resp).iter().all(|(k, _)| k != "retry-after"));
    // No limit applies: OK, no current_limit, no headers.
    let resp = call(&svc, rls("edge", &[&[("free", "x")], &[("other", "y")]], 0))
        .await
        .unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    for s in &resp.statuses {
        assert_eq!(s.code, Code::Ok as i32);
        assert!(s.current_limit.is_none() && s.duration_until_reset.is_none());
        assert_eq!(s.limit_remaining, 0);
    }
    assert!(resp.response_headers_to_add.is_empty());
    assert_eq!(resp.statuses.len(), 2);
}

#[tokio::test]
async fn hits_addend_request_and_per_descriptor() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let resp = call(&svc, rls("edge", &[&[("tokens", "t")]], 5))
        .await
        .unwrap();
    assert_eq!(resp.statuses[0].limit_remaining, 95);
    // The descriptor's own hits_addend wins; 0 checks without spending.
    let mut req = rls("edge", &[], 50);
    req.descriptors.push(rls_desc(&[("tokens", "t")], Some(0)));
    req.descriptors.push(rls_desc(&[("tokens", "u")], Some(7)));
    let resp = call(&svc, req).await.unwrap();
    assert_eq!(resp.statuses[0].limit_remaining, 95);
    assert_eq!(resp.statuses[1].limit_remaining, 93);
}

#[tokio::test]
async fn invalid_input_is_over_limit_with_its_reason_and_spends_nothing() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let mut huge = rls("edge", &[], 0);
    huge.descriptors
        .push(rls_desc(&[("tokens", "t")], Some(1 << 32)));
    let mut negative = rls("edge", &[&[("tokens", "t")]], 0);
    negative.descriptors[0].is_negative_hits = true;
    let many: Vec<&[(&str, &str)]> = vec![&[("tokens", "t")]; 33];
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (rls("edge", &[], 0), "request has no descriptors"),
        (rls("", &[&[("tokens", "t")]], 0), "domain is empty"),
        (
            rls("edge", &[&[("tokens", "")]], 0),
            "descriptors[0].entries[0].value is empty",
        ),
        (
            rls("edge", &[&[("tokens", "t")], &[]], 0),
            "descriptors[1] has no entries",
        ),
        (huge, "descriptors[0].hits_addend is 4294967296"),
        (rls("edge", &many, 0), "request has 33 descriptors"),
        (negative, "is_negative_hits is not supported"),
    ];
    // Envoy lets a request through on an RLS error by default, and descriptor values come from
    // request headers: invalid input must be refused as OVER_LIMIT, never as an error.
    for (req, msg) in cases {
        let n = req.descriptors.len();
        let resp = call(&svc, req).await.expect("never an RLS error");
        assert_eq!(resp.overall_code, Code::OverLimit as i32, "{msg}");
        assert_eq!(resp.statuses.len(), n, "{msg}");
        assert!(
            resp.statuses
                .iter()
                .all(|s| s.code == Code::OverLimit as i32),
            "{msg}"
        );
        assert!(
            !resp
                .response_headers_to_add
                .iter()
                .any(|h| h.key == "retry-after"),
            "{msg}: retrying cannot help"
        );
        let body: serde_json::Value = serde_json::from_slice(&resp.raw_body).expect("JSON body");
        assert_eq!(body["error"], "invalid_argument", "{msg}");
        let text = body["message"].as_str().unwrap_or_default();
        assert!(text.contains(msg), "{text:?} does not name {msg:?}");
    }
    // A 2 KB header value (descriptor values come from headers) is refused, not let through.
    let long = "x".repeat(2048);
    let resp = call(&svc, rls("edge", &[&[("tokens", long.as_str())]], 0))
        .await
        .expect("never an RLS error");
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    let mut peek = rls("edge", &[], 0);
    peek.descriptors.push(rls_desc(&[("tokens", "t")], Some(0)));
    let resp = call(&svc, peek).await.unwrap();
    assert_eq!(resp.statuses[0].limit_remaining, 100, "nothing was spent");
}

/// Envoy lets a request through on an RLS error unless `failure_mode_deny` is set, so a request
/// that can never pass is OVER_LIMIT (no retry-after, as the core answers), never an error; an
/// unknown domain is OK with no limit, as envoyproxy/ratelimit answers (issue 10 item 16).
#[tokio::test]
async fn never_passing_cost_is_over_limit_and_unknown_domain_is_ok() {
    let r = rig(LOCAL);
    let svc = RlsService::new(r.decider.clone());
    let resp = call(
        &svc,
        rls("edge", &[&[("tokens", "t")], &[("free", "x")]], 101),
    )
    .await
    .unwrap();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(resp.statuses[0].limit_remaining, 100);
    assert!(headers(&resp).iter().all(|(k, _)| k != "retry-after"));
    let resp = call(&svc, rls("nope", &[&[("tokens", "t")], &[("a", "b")]], 0))
        .await
        .unwrap();
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(resp.statuses.len(), 2);
    assert!(resp
        .statuses
        .iter()
        .all(|s| s.code == Code::Ok as i32 && s.current_limit.is_none()));
    assert!(resp.response_headers_to_add.is_empty());
    let mut peek = rls("edge", &[], 0);
    peek.descriptors.push(rls_desc(&[("tokens", "t")], Some(0)));
    let resp = call(&svc, peek).await.unwrap();
    assert_eq!(resp.statuses[0].limit_remaining, 100, "nothing was spent");
}

#[tokio::test]
async fn over_loopback_grpc() {
    let r = rig(LOCAL);
    let servers = Servers::start(r.decider.clone()).await;
    let mut c = RateLimitServiceClient::connect(servers.grpc_url())
        .await
        .unwrap();
    let req = || rls("edge", &[&[("client", "z")]], 0);
    for _ in 0..3 {
        let resp = c.should_rate_limit(req()).await.unwrap().into_inner();
        assert_eq!(resp.overall_code, Code::Ok as i32);
    }
    let resp = c.should_rate_limit(req()).await.unwrap().into_inner();
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(
        headers(&resp),
        h(&[
            ("RateLimit-Limit", "3"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "60"),
            ("retry-after", "20"),
        ])
    );
    let resp = c
        .should_rate_limit(rls("nope", &[&[("client", "z")]], 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.overall_code, Code::Ok as i32);
}

/// Sends `body` as the raw `ShouldRateLimit` message (bytes no typed client would encode).
async fn raw_should_rate_limit(url: &str, body: Vec<u8>) -> Result<RateLimitResponse, Status> {
    let channel = tonic::transport::Channel::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path =
        PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// Encodes a request's bytes as they are; decodes the response with prost.
struct RawCodec;
struct RawEncoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = RateLimitResponse;
    type Encoder = RawEncoder;
    type Decoder = ProstDecoder<RateLimitResponse>;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

/// Envoy copies header values (HTTP/1 obs-text: bytes 0x80–0xFF) into the request's `string`
/// fields unchecked. Such a request was INVALID_ARGUMENT before the handler ran, which Envoy lets
/// through by default: it is OVER_LIMIT with the field named, nothing spent, counted invalid; a
/// body that is no protobuf at all stays INVALID_ARGUMENT (issue 10 item 16).
#[tokio::test]
async fn non_utf8_strings_over_loopback_are_over_limit_and_spend_nothing() {
    let r = rig(LOCAL);
    let servers = Servers::start(r.decider.clone()).await;
    let url = servers.grpc_url();
    let encode =
        |d: &str, k: &str, v: &str| rls(d, &[&[(k, v)], &[("free", "x")]], 0).encode_to_vec();
    let patch = |mut b: Vec<u8>, from: &[u8], to: &[u8]| {
        let at = b.windows(from.len()).position(|w| w == from).unwrap();
        b[at..at + from.len()].copy_from_slice(to);
        b
    };
    let cases = [
        (
            patch(
                encode("edge", "client", "ZZ\u{1}"),
                b"ZZ\x01",
                b"\xff\xfe\x80",
            ),
            "descriptors[0].entries[0].value is not UTF-8",
        ),
        (
            patch(encode("edge", "clienQ", "z"), b"clienQ", b"clien\xc3"),
            "descriptors[0].entries[0].key is not UTF-8",
        ),
        (
            patch(encode("edgQ", "client", "z"), b"edgQ", b"edg\xe9"),
            "domain is not UTF-8",
        ),
    ];
    let invalid_before = r.decider.metrics().requests.invalid.load(Ordering::Relaxed);
    for (body, msg) in cases {
        let resp = raw_should_rate_limit(&url, body)
            .await
            .expect("never an RLS error");
        assert_eq!(resp.overall_code, Code::OverLimit as i32, "{msg}");
        assert_eq!(resp.statuses.len(), 2, "{msg}");
        assert!(resp
            .statuses
            .iter()
            .all(|s| s.code == Code::OverLimit as i32));
        assert!(headers(&resp).iter().all(|(k, _)| k != "retry-after"));
        let body: serde_json::Value = serde_json::from_slice(&resp.raw_body).expect("JSON body");
        assert_eq!(
            body,
            serde_json::json!({"error": "invalid_argument", "message": msg})
        );
    }
    let invalid_after = r.decider.metrics().requests.invalid.load(Ordering::Relaxed);
    assert_eq!(
        invalid_after - invalid_before,
        3,
        "each refusal counted invalid"
    );
    // Not a protobuf at all (field 2 claims 100 bytes, 2 follow): an error, as before.
    let err = raw_should_rate_limit(&url, b"\x12\x64\x0a\x00".to_vec())
        .await
        .expect_err("not a protobuf");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Nothing was spent and the agent still answers: the valid bytes pass the same decoder.
    for remaining in [2u32, 1, 0] {
        let resp = raw_should_rate_limit(&url, encode("edge", "client", "z"))
            .await
            .unwrap();
        assert_eq!(resp.overall_code, Code::Ok as i32);
        assert_eq!(resp.statuses[0].limit_remaining, remaining);
    }
}
