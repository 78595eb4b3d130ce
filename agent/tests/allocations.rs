//! The decision path allocates nothing per request (issue 13 item 5), counted by a counting
//! global allocator over 10,000 decisions each (its own test binary, so no other test runs
//! under it): (a) the decision core's `Limiter`; (b) the agent's `Enforcer` and `Decider` for
//! a local and a leased rule (a key holding an allocation, spent on the hot path), metrics
//! included; (c) each adapter's translation of a decoded request into the core's `Request`
//! and back into its wire answer:
//!
//! * RLS: from a decoded `RateLimitRequest` to the encoded `RateLimitResponse`, written into a
//!   reused buffer by the same encoder the gRPC server uses (`RlsAnswer`);
//! * native: from a decoded `CheckRequest` to the encoded `CheckResponse` (`NativeAnswer`);
//! * HTTP: from the request body's bytes (read borrowed) to the JSON answer's bytes (200 or
//!   429) and the RateLimit header values; the response's own buffer and header map are
//!   axum's (transport).
//!
//! Excluded, because they are the transport's and not the translation's: tonic's and hyper's
//! buffers, HTTP/2 frames and header maps; the decoding of the protobuf request into prost's
//! owned message (its `String`s and `Vec`s, done by the codec before the service runs); the
//! boxed future of each RPC (a tower `Service` must name its future, which an `async` block
//! cannot be on stable Rust without a box — tonic's generated servers box the same way); and
//! axum's `Request`/`Response` objects. Everything from the decoded message to the bytes of
//! the answer is counted.
//!
//! Allocations are counted per thread, only while a measurement runs, so the harness's own
//! threads do not disturb the counts. Every rig is warmed up first (keys created, per-thread
//! caches and pools filled): the steady state is what is measured.

use allot_agent::api::native::NativeService;
use allot_agent::api::rls::{RlsAnswer, RlsService};
use allot_agent::api::{http, rate_limit_header_values, Decider, TrackingSettings, WireRequest};
use allot_agent::lease::{HeldAllocation, LeaseBook, LeaseSettings};
use allot_agent::metrics::Metrics;
use allot_agent::Enforcer;
use allot_common::clock::{Clock, ManualClock};
use allot_common::config::ConfigSet;
use allot_common::descriptor::{Descriptor, Entry, Request};
use allot_common::limiter::{Code, Limiter};
use allot_proto::allot::v1 as pb;
use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use prost::Message;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::path::Path;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// Counts allocations (and reallocations) of the current thread while armed.
struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

fn count_one() {
    // `try_with`: the thread's locals may be gone while it exits.
    let armed = ARMED.try_with(Cell::get).unwrap_or(false);
    if armed {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the count only reads and
// writes two thread-local cells, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Decisions per measurement.
const N: u64 = 10_000;

/// Allocations made by `N` calls of `f` on this thread, after 100 unmeasured ones.
fn allocations(mut f: impl FnMut()) -> u64 {
    for _ in 0..100 {
        f();
    }
    COUNT.with(|c| c.set(0));
    ARMED.with(|a| a.set(true));
    for _ in 0..N {
        f();
    }
    ARMED.with(|a| a.set(false));
    COUNT.with(Cell::get)
}

/// Polls `fut` to completion on this thread; a decision that needs no allocator call completes
/// at the first poll (no runtime, so the count is the decision's alone).
fn ready<F: Future>(fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the decision waited (it should not need the allocator here)"),
    }
}

const POLICY: &str = "domain: edge
descriptors:
  - key: tenant
    value: local
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 4000000000, scope: local, name: local-rule}
  - key: tenant
    value: leased
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 4000000000, lease: {max_grant: 4000000000}, name: leased-rule}
  - key: path
    rate_limit: {unit: second, requests_per_unit: 1000000000, burst: 4000000000, scope: local, name: per-path}
  - key: tiny
    rate_limit: {unit: hour, requests_per_unit: 2, scope: local, name: tiny}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, scope: local, name: shadowed}
  - key: free
    rate_limit: {unlimited: true}
";

fn config() -> ConfigSet {
    ConfigSet::from_yaml(POLICY, Path::new("edge.yaml")).expect("valid policy")
}

/// An agent on a manual clock whose leased key holds one large allocation (no allocator runs:
/// the lease events go nowhere).
struct Rig {
    clock: ManualClock,
    decider: Arc<Decider>,
}

fn rig() -> Rig {
    let clock = ManualClock::new(1_000_000_000_000);
    let shared: Arc<dyn Clock> = Arc::new(clock.clone());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::mem::forget(rx);
    let book = Arc::new(LeaseBook::new(shared, LeaseSettings::new("a1", "eu"), tx));
    let enforcer = Arc::new(Enforcer::new(config(), book.clone()));
    // Make the leased key warm: see it once, then hand it a big allocation.
    let leased = [Entry {
        key: "tenant",
        value: "leased",
    }];
    let descriptors = [Descriptor {
        entries: &leased,
        hits_addend: None,
    }];
    let req = Request {
        domain: "edge",
        descriptors: &descriptors,
        hits_addend: None,
    };
    let mut st = Vec::new();
    let _ = enforcer.decide_now(&req, &mut st);
    let kl = book.existing("edge", 1, &leased).expect("leased key");
    let now = clock.now();
    kl.value.protocol.install(Arc::new(HeldAllocation::new(
        1,
        1,
        u64::MAX / 2,
        now + 3_600_000_000_000,
        0,
        1,
    )));
    assert_eq!(enforcer.decide_now(&req, &mut st).unwrap().code, Code::Ok);
    let metrics = Arc::new(Metrics::new(book).expect("metrics"));
    let decider = Arc::new(Decider::new(enforcer, metrics, TrackingSettings::default()));
    Rig { clock, decider }
}

/// Binds `$r1`, a one-descriptor request of `$tenant`'s entry, and `$r2`, a two-descriptor one
/// of `$both`'s two entries.
macro_rules! requests {
    ($tenant:ident, $both:ident => $r1:ident, $r2:ident) => {
        let one = [Descriptor {
            entries: &$tenant,
            hits_addend: None,
        }];
        let two = [
            Descriptor {
                entries: &$both[..1],
                hits_addend: None,
            },
            Descriptor {
                entries: &$both[1..],
                hits_addend: None,
            },
        ];
        let $r1 = Request {
            domain: "edge",
            descriptors: &one,
            hits_addend: None,
        };
        let $r2 = Request {
            domain: "edge",
            descriptors: &two,
            hits_addend: None,
        };
    };
}

#[test]
fn the_core_limiter_allocates_nothing_per_decision() {
    let clock = ManualClock::new(1_000);
    let l = Limiter::new(config(), clock.now());
    let tenant = [Entry {
        key: "tenant",
        value: "local",
    }];
    let both = [
        Entry {
            key: "tenant",
            value: "local",
        },
        Entry {
            key: "path",
            value: "/a",
        },
    ];
    requests!(tenant, both => r1, r2);
    let mut st = Vec::with_capacity(4);
    let n = allocations(|| {
        clock.advance(1);
        assert_eq!(l.decide(&r1, clock.now(), &mut st).unwrap().code, Code::Ok);
    });
    assert_eq!(n, 0, "one descriptor: {n} allocations over {N} decisions");
    let n = allocations(|| {
        clock.advance(1);
        assert_eq!(l.decide(&r2, clock.now(), &mut st).unwrap().code, Code::Ok);
    });
    assert_eq!(n, 0, "two descriptors: {n} allocations over {N} decisions");
}

#[test]
fn the_enforcer_and_the_decider_allocate_nothing_per_decision() {
    let rig = rig();
    let enforcer = rig.decider.enforcer().clone();
    for value in ["local", "leased"] {
        let tenant = [Entry {
            key: "tenant",
            value,
        }];
        let both = [
            Entry {
                key: "tenant",
                value,
            },
            Entry {
                key: "path",
                value: "/a",
            },
        ];
        requests!(tenant, both => r1, r2);
        let mut st = Vec::with_capacity(4);
        for (what, req) in [("one descriptor", &r1), ("two descriptors", &r2)] {
            let n = allocations(|| {
                rig.clock.advance(1);
                assert_eq!(enforcer.decide_now(req, &mut st).unwrap().code, Code::Ok);
            });
            assert_eq!(
                n, 0,
                "Enforcer::decide_now, {value}, {what}: {n} allocations"
            );
            let mut permits = Vec::new();
            let n = allocations(|| {
                rig.clock.advance(1);
                let (o, _, _) =
                    ready(enforcer.decide_with_slots(req, &mut st, &mut permits, false)).unwrap();
                assert_eq!(o.code, Code::Ok);
            });
            assert_eq!(
                n, 0,
                "Enforcer::decide_with_slots, {value}, {what}: {n} allocations"
            );
            let n = allocations(|| {
                rig.clock.advance(1);
                let v = ready(rig.decider.check(req, None)).unwrap();
                assert!(v.is_ok());
            });
            assert_eq!(
                n, 0,
                "Decider::check (metrics included), {value}, {what}: {n} allocations"
            );
        }
    }
}

fn rls_request(values: &[&str]) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".to_string(),
        descriptors: values
            .iter()
            .map(|v| {
                let (key, value) = v.split_once('=').expect("key=value");
                RateLimitDescriptor {
                    entries: vec![rate_limit_descriptor::Entry {
                        key: key.to_string(),
                        value: value.to_string(),
                    }],
                    ..Default::default()
                }
            })
            .collect(),
        hits_addend: 0,
    }
}

#[test]
fn the_rls_adapter_allocates_nothing_from_decoded_request_to_encoded_answer() {
    let rig = rig();
    let service = RlsService::new(rig.decider.clone());
    let mut out = Vec::with_capacity(1024);
    for values in [
        &["tenant=local"][..],
        &["tenant=leased"],
        &["tenant=leased", "path=/a"],
        &["tenant=nobody"],
    ] {
        let req = rls_request(values);
        let n = allocations(|| {
            rig.clock.advance(1);
            let answer: RlsAnswer = ready(service.answer_decoded(&req)).unwrap();
            out.clear();
            answer.encode_into(&mut out);
            assert!(!out.is_empty());
        });
        assert_eq!(n, 0, "RLS {values:?}: {n} allocations over {N} requests");
    }
}

fn native_request(values: &[&str]) -> pb::CheckRequest {
    pb::CheckRequest {
        domain: "edge".to_string(),
        descriptors: values
            .iter()
            .map(|v| {
                let (key, value) = v.split_once('=').expect("key=value");
                pb::RequestDescriptor {
                    entries: vec![pb::DescriptorEntry {
                        key: key.to_string(),
                        value: value.to_string(),
                    }],
                    hits_addend: None,
                }
            })
            .collect(),
        ..Default::default()
    }
}

/// The HTTP adapter's translation, as the `/v1/check` handler does it: the body's bytes
/// parsed, decided, and the answer (200 or 429) written as JSON into a reused buffer, with the
/// RateLimit header values. Whether it was allowed.
fn http_round_trip(decider: &Decider, body: &[u8], out: &mut Vec<u8>) -> bool {
    let b: http::CheckBody = serde_json::from_slice(body).unwrap();
    let w = WireRequest::read(&b.domain, &b.descriptors, "cost", b.cost.unwrap_or(0)).unwrap();
    let descriptors = w.descriptors();
    let v = ready(decider.check(&w.request(&descriptors), None)).unwrap();
    out.clear();
    let answer = http::HttpAnswer {
        verdict: &v,
        reservation: None,
    };
    serde_json::to_writer(&mut *out, &answer).unwrap();
    let headers = rate_limit_header_values(&v);
    assert!(!headers.is_empty());
    v.is_ok()
}

#[test]
fn the_native_adapter_allocates_nothing_from_decoded_request_to_encoded_answer() {
    let rig = rig();
    let service = NativeService::new(rig.decider.clone());
    let mut out = Vec::with_capacity(1024);
    for values in [
        &["tenant=local"][..],
        &["tenant=leased"],
        &["tenant=leased", "path=/a"],
    ] {
        let req = native_request(values);
        let n = allocations(|| {
            rig.clock.advance(1);
            let answer = ready(service.check_answer(&req)).unwrap();
            out.clear();
            answer.encode_into(&mut out);
            assert!(!out.is_empty());
        });
        assert_eq!(n, 0, "native {values:?}: {n} allocations over {N} requests");
    }
}

/// The HTTP adapter from the body's bytes to the JSON answer: the body is read borrowed (up to
/// 4 descriptors of up to 4 entries without JSON escapes), the answer serialized straight from
/// the verdict into a reused buffer (an allowed one and a 429), the RateLimit header values
/// taken as numbers; a body with a `request_id` is read without copying it either.
#[test]
fn the_http_adapter_allocates_nothing_from_body_to_answer() {
    let rig = rig();
    let mut out = Vec::with_capacity(4096);
    for (body, allowed) in [
        (&br#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"leased"}]},{"entries":[{"key":"path","value":"/a"}]}]}"#[..], true),
        (br#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"local"}]}],"cost":1}"#, true),
        // Two an hour: from the third on, every one is a 429.
        (br#"{"domain":"edge","descriptors":[{"entries":[{"key":"tiny","value":"http"}]}]}"#, false),
    ] {
        let text = String::from_utf8_lossy(body);
        if !allowed {
            // Its two an hour, spent before measuring.
            assert!(http_round_trip(&rig.decider, body, &mut out));
            assert!(http_round_trip(&rig.decider, body, &mut out));
        }
        let n = allocations(|| {
            rig.clock.advance(1);
            assert_eq!(http_round_trip(&rig.decider, body, &mut out), allowed, "{text}");
        });
        assert_eq!(n, 0, "HTTP {text}: {n} allocations over {N} requests");
    }
    let with_id = br#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"local"}]}],"request_id":"r-1"}"#;
    let n = allocations(|| {
        let b: http::CheckBody = serde_json::from_slice(with_id).unwrap();
        assert!(matches!(
            b.request_id,
            Some(std::borrow::Cow::Borrowed("r-1"))
        ));
    });
    assert_eq!(
        n, 0,
        "a request_id is borrowed: {n} allocations over {N} bodies"
    );
}

/// A body past the core's limits is refused while it is read, with the core's message, without
/// holding what lies beyond the limit (a 2 MB body of empty descriptors used to be held whole).
#[test]
fn oversized_arrays_are_refused_while_reading() {
    let many = format!(
        r#"{{"domain":"edge","descriptors":[{}]}}"#,
        vec![r#"{"entries":[]}"#; 100_000].join(",")
    );
    let refused = |body: &str, why: &str| {
        let e = serde_json::from_str::<http::CheckBody>(body)
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{e}");
    };
    refused(
        &many,
        "request has 100000 descriptors; at most 32 are accepted",
    );
    let entries = vec![r#"{"key":"k","value":"v"}"#; 17].join(",");
    let wide = format!(r#"{{"domain":"edge","descriptors":[{{"entries":[{entries}]}}]}}"#);
    refused(
        &wide,
        "a descriptor has 17 entries; at most 16 are accepted",
    );
    let ok = vec![r#"{"key":"k","value":"v"}"#; 16].join(",");
    let at_limit = format!(r#"{{"domain":"edge","descriptors":[{{"entries":[{ok}]}}]}}"#);
    let b: http::CheckBody = serde_json::from_str(&at_limit).unwrap();
    assert_eq!(b.descriptors[0].entries.len(), 16);
}

/// A value with a JSON escape is unescaped into a string of its own (an allocation), and
/// decides as the same value written plainly: `\u0065dge` is `edge`.
#[test]
fn an_escaped_json_string_reads_as_its_unescaped_value() {
    let rig = rig();
    let mut plain = Vec::new();
    let mut escaped = Vec::new();
    assert!(http_round_trip(
        &rig.decider,
        br#"{"domain":"edge","descriptors":[{"entries":[{"key":"tenant","value":"local"}]}]}"#,
        &mut plain,
    ));
    let b: http::CheckBody = serde_json::from_slice(
        br#"{"domain":"\u0065dge","descriptors":[{"entries":[{"key":"tenant","value":"loc\u0061l"}]}]}"#,
    )
    .unwrap();
    assert_eq!(b.domain, "edge");
    assert_eq!(b.descriptors[0].entries[0].value, "local");
    http_round_trip(
        &rig.decider,
        br#"{"domain":"\u0065dge","descriptors":[{"entries":[{"key":"tenant","value":"loc\u0061l"}]}]}"#,
        &mut escaped,
    );
    let (p, e): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(&plain).unwrap(),
        serde_json::from_slice(&escaped).unwrap(),
    );
    assert_eq!(p["policy"], e["policy"]);
    assert_eq!(p["code"], "OK");
    assert_eq!(e["code"], "OK");
}

/// Native requests for every kind of answer, in order on one rig: allowed local and leased,
/// several descriptors, denied with a wait (`tiny` twice), shadow denials, a cost above the
/// capacity, unlimited and no rule.
fn native_cases() -> Vec<pb::CheckRequest> {
    vec![
        native_request(&["tenant=local"]),
        native_request(&["tenant=leased", "path=/a", "free=x", "nothing=y"]),
        native_request(&["tiny=a"]),
        native_request(&["tiny=a"]),
        native_request(&["tiny=a", "tenant=local"]),
        native_request(&["shadow=s", "shadow=s"]),
        pb::CheckRequest {
            cost: 5,
            ..native_request(&["tiny=b"])
        },
        native_request(&["free=x"]),
        native_request(&["nothing=y"]),
    ]
}

#[test]
fn the_encoded_native_answer_is_prost_s_encoding_of_the_response() {
    let rig = rig();
    let service = NativeService::new(rig.decider.clone());
    let cases = native_cases();
    for (i, req) in cases.iter().enumerate() {
        rig.clock.advance(1_000_000);
        let answer = ready(service.check_answer(req)).unwrap();
        let mut ours = Vec::new();
        answer.encode_into(&mut ours);
        assert_eq!(
            ours,
            answer.to_response().encode_to_vec(),
            "case {i}: {req:?}"
        );
    }
}

/// The JSON written straight from a verdict is the native `Decision` message in JSON, field
/// for field, as the HTTP API documents it (the same cases as above): codes and reasons by name
/// (`OVER_LIMIT`, `within_limit`), a limit's `requests_per_unit` and `unit` only with its
/// `remaining`, `retry_after_ms` and `remaining` only when given.
#[test]
fn the_json_answer_is_the_native_decision_field_for_field() {
    let rig = rig();
    let service = NativeService::new(rig.decider.clone());
    let code = |c: i32| {
        if c == pb::DecisionCode::OverLimit as i32 {
            "OVER_LIMIT"
        } else {
            "OK"
        }
    };
    let reason = |r: i32| {
        pb::DecisionReason::try_from(r)
            .unwrap()
            .as_str_name()
            .trim_start_matches("DECISION_REASON_")
            .to_ascii_lowercase()
    };
    let cases = native_cases();
    for (i, req) in cases.iter().enumerate() {
        rig.clock.advance(1_000_000);
        let answer = ready(service.check_answer(req)).unwrap();
        let d = answer.to_response().decision.unwrap();
        let mut want = serde_json::json!({
            "code": code(d.code),
            "reason": reason(d.reason),
            "policy": d.policy,
            "policy_version": d.policy_version,
            "descriptors": d.descriptors.iter().map(|x| {
                let mut o = serde_json::json!({
                    "code": code(x.code),
                    "reason": reason(x.reason),
                    "policy": x.policy,
                    "reset_after_ms": x.reset_after_ms,
                    "shadow_over_limit": x.shadow_over_limit,
                });
                if let Some(r) = x.remaining {
                    o["remaining"] = r.into();
                    o["requests_per_unit"] = x.requests_per_unit.into();
                    o["unit"] = x.unit.clone().into();
                }
                if let Some(m) = x.max_in_flight {
                    o["max_in_flight"] = m.into();
                }
                o
            }).collect::<Vec<_>>(),
            "reset_after_ms": d.reset_after_ms,
        });
        if let Some(r) = d.retry_after_ms {
            want["retry_after_ms"] = r.into();
        }
        if let Some(r) = d.remaining {
            want["remaining"] = r.into();
        }
        let got = serde_json::to_value(http::JsonAnswer(&answer.0)).unwrap();
        assert_eq!(got, want, "case {i}: {req:?}");
        let body = serde_json::to_value(http::HttpAnswer {
            verdict: &answer.0,
            reservation: Some(("res-1", 7)),
        })
        .unwrap();
        if answer.0.is_ok() {
            want["reservation_id"] = "res-1".into();
            want["expires_in_ms"] = 7.into();
        } else {
            want = serde_json::json!({
                "error": "rate_limit_exceeded",
                "policy": answer.0.policy_label(),
            });
            if answer.0.never_passes() {
                want["reason"] = "never".into();
            }
        }
        assert_eq!(body, want, "case {i} as an HTTP answer: {req:?}");
    }
}

#[test]
fn the_encoded_rls_answer_is_prost_s_encoding_of_the_response() {
    // Every kind of answer: allowed local and leased, denied with a wait, a cost that can never
    // pass, shadow denials, no rule, unlimited, several descriptors, an unknown domain and
    // invalid input; the bytes the server sends are those of prost's encoding of the message
    // the answer stands for.
    let rig = rig();
    let service = RlsService::new(rig.decider.clone());
    let cases: Vec<RateLimitRequest> = vec![
        rls_request(&["tenant=local"]),
        rls_request(&["tenant=leased"]),
        rls_request(&["tenant=leased", "path=/a", "free=x", "nothing=y"]),
        rls_request(&["tiny=a"]),
        rls_request(&["tiny=a"]),
        rls_request(&["tiny=a", "tenant=local"]),
        rls_request(&["shadow=s"]),
        rls_request(&["shadow=s", "shadow=s"]),
        RateLimitRequest {
            hits_addend: 5,
            ..rls_request(&["tiny=b"])
        },
        RateLimitRequest {
            domain: "elsewhere".to_string(),
            ..rls_request(&["tenant=local", "x=y"])
        },
        RateLimitRequest {
            hits_addend: u32::MAX,
            ..rls_request(&["tenant=local"])
        },
        rls_request(&["=empty"]),
    ];
    for (i, req) in cases.iter().enumerate() {
        rig.clock.advance(1_000_000);
        let answer = ready(service.answer_decoded(req)).unwrap();
        let mut ours = Vec::new();
        answer.encode_into(&mut ours);
        assert_eq!(
            ours,
            answer.to_response().encode_to_vec(),
            "case {i}: {req:?}"
        );
    }
}
