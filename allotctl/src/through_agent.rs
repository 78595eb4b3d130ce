//! `allotctl replay --through agent`: the trace decided by an agent's own gateway APIs, in
//! process, on the replay clock, so the decision contract is checked through the agent too.
//!
//! Two agents are built from the same config: one answers every request through the native
//! `allot.v1.Agent/Check` handler (its answer is the output line, as it carries every field of
//! the contract), the other through Envoy's `RateLimitService/ShouldRateLimit` handler. The RLS
//! answer must say the same in every field it carries (codes, `limit_remaining`,
//! `duration_until_reset`, `retry-after`); a difference is printed as an error line, so the case
//! fails. No allocator takes part: every rule is enforced by the agent alone (`scope: local`,
//! design §2), which is what a single limiter replaying the trace is.
//!
//! A cost above a limit's capacity is OVER_LIMIT with no Retry-After through both APIs, as in
//! the core replay (issue 10 item 16: an error would let the request through a gateway that
//! fails open). One answer differs between the two APIs by design: an unknown domain is refused
//! as invalid by Check (as by the core replay) but OK with no limits on Envoy's RLS, as
//! envoyproxy/ratelimit answers it; the Check answer is the output line.

use crate::replay::{code_str, DecidedRequest, Decider, StatusLine};
use crate::wire::OwnedRequest;
use allot_agent::api::native::NativeService;
use allot_agent::api::rls::RlsService;
use allot_agent::api::TrackingSettings;
use allot_agent::lease::LeaseSettings;
use allot_agent::server::Agent;
use allot_common::clock::{Clock, ManualClock};
use allot_common::config::{ConfigSet, Scope};
use allot_common::limiter::Code;
use allot_common::units::Nanos;
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_server::Agent as _;
use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code as RlsCode;
use allot_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use anyhow::{Context, Result};
use std::sync::Arc;

/// Decides through two in-process agents (native and RLS) sharing one manual clock.
pub struct AgentDecider {
    clock: ManualClock,
    native: NativeService,
    native_agent: Agent,
    rls: RlsService,
    rls_agent: Agent,
    runtime: tokio::runtime::Runtime,
}

impl AgentDecider {
    /// Two agents deciding with `set` (every rule made `scope: local`) from time 0.
    ///
    /// # Errors
    /// When an agent cannot be built or the runtime cannot start.
    pub fn new(set: ConfigSet) -> Result<Self> {
        let clock = ManualClock::new(0);
        let build = |id: &str| -> Result<Agent> {
            let shared: Arc<dyn Clock> = Arc::new(clock.clone());
            Agent::build(
                set.clone().with_scope(Scope::Local),
                LeaseSettings::new(id, "replay"),
                TrackingSettings::default(),
                &[],
                shared,
            )
            .with_context(|| format!("building the {id} agent"))
        };
        let (native_agent, rls_agent) = (build("replay-native")?, build("replay-rls")?);
        Ok(AgentDecider {
            native: NativeService::new(native_agent.decider.clone()),
            rls: RlsService::new(rls_agent.decider.clone()),
            native_agent,
            rls_agent,
            clock,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()?,
        })
    }
}

impl Decider for AgentDecider {
    fn apply(&mut self, set: ConfigSet, now_ns: Nanos) -> Result<()> {
        self.clock.set(now_ns);
        for a in [&self.native_agent, &self.rls_agent] {
            a.decider.apply(set.clone().with_scope(Scope::Local));
        }
        Ok(())
    }

    fn decide(&mut self, req: &OwnedRequest, now_ns: Nanos) -> Result<DecidedRequest, String> {
        self.clock.set(now_ns);
        let native = self
            .runtime
            .block_on(self.native.check(tonic::Request::new(check_request(req))))
            .map(|r| r.into_inner().decision.unwrap_or_default())
            .map_err(|s| s.message().to_string());
        let rls = self.runtime.block_on(self.rls.decide(&rls_request(req)));
        let decided = native.map(|d| decided(&d));
        match (&decided, &rls) {
            (Ok(d), Ok(r)) => agree(d, r)?,
            (Err(_), Err(_)) => {}
            (Err(e), Ok(r)) if unknown_domain(e, r) => {}
            (Ok(_), Err(e)) => return Err(format!("RLS refused what Check decided: {e}")),
            (Err(e), Ok(_)) => return Err(format!("RLS decided what Check refused: {e}")),
        }
        decided
    }
}

/// Whether Check refused an unknown domain and the RLS answered it as envoyproxy/ratelimit does:
/// OK, every status OK without a limit.
fn unknown_domain(check_error: &str, r: &RateLimitResponse) -> bool {
    check_error.starts_with("unknown domain")
        && r.overall_code == RlsCode::Ok as i32
        && r.statuses
            .iter()
            .all(|s| s.code == RlsCode::Ok as i32 && s.current_limit.is_none())
}

fn check_request(req: &OwnedRequest) -> pb::CheckRequest {
    pb::CheckRequest {
        domain: req.domain.clone(),
        descriptors: req
            .descriptors
            .iter()
            .map(|(entries, hits)| pb::RequestDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| pb::DescriptorEntry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                hits_addend: *hits,
            })
            .collect(),
        cost: req.hits_addend.unwrap_or(0),
        ..Default::default()
    }
}

fn rls_request(req: &OwnedRequest) -> RateLimitRequest {
    RateLimitRequest {
        domain: req.domain.clone(),
        descriptors: req
            .descriptors
            .iter()
            .map(|(entries, hits)| RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| rate_limit_descriptor::Entry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                hits_addend: *hits,
                ..Default::default()
            })
            .collect(),
        // The trace's parser already refused a request cost beyond u32.
        hits_addend: u32::try_from(req.hits_addend.unwrap_or(0)).unwrap_or(u32::MAX),
    }
}

fn code(c: i32) -> Code {
    if c == pb::DecisionCode::OverLimit as i32 {
        Code::OverLimit
    } else {
        Code::Ok
    }
}

/// The contract's line from a native decision.
fn decided(d: &pb::Decision) -> DecidedRequest {
    let overall = code(d.code);
    DecidedRequest {
        code: overall,
        // Whole seconds, rounded up, at least 1 (the ms value is already rounded up, and
        // rounding up twice equals rounding the nanoseconds up once).
        retry_after_s: d
            .retry_after_ms
            .filter(|_| overall == Code::OverLimit)
            .map(|ms| ms.div_ceil(1000).max(1)),
        policy_version: d.policy_version,
        statuses: d
            .descriptors
            .iter()
            .map(|s| StatusLine {
                code: code_str(code(s.code)),
                current_limit: None,
                limit_remaining: s.remaining,
                duration_until_reset_ms: s.remaining.map(|_| s.reset_after_ms),
                shadow_over_limit: s.shadow_over_limit,
                policy: (!s.policy.is_empty()).then(|| s.policy.clone()),
            })
            .collect(),
    }
}

/// Checks that the RLS answer says what the native one does, in every field it carries.
fn agree(d: &DecidedRequest, r: &RateLimitResponse) -> Result<(), String> {
    let rls_code = |c: i32| {
        if c == RlsCode::OverLimit as i32 {
            "OVER_LIMIT"
        } else {
            "OK"
        }
    };
    let mut diffs = Vec::new();
    if rls_code(r.overall_code) != code_str(d.code) {
        diffs.push(format!(
            "overall_code {} vs {}",
            rls_code(r.overall_code),
            code_str(d.code)
        ));
    }
    if r.statuses.len() != d.statuses.len() {
        diffs.push(format!(
            "{} statuses vs {}",
            r.statuses.len(),
            d.statuses.len()
        ));
    }
    for (i, (rs, s)) in r.statuses.iter().zip(&d.statuses).enumerate() {
        if rls_code(rs.code) != s.code {
            diffs.push(format!(
                "statuses[{i}].code {} vs {}",
                rls_code(rs.code),
                s.code
            ));
        }
        if let Some(left) = s.limit_remaining {
            let want = u32::try_from(left).unwrap_or(u32::MAX);
            if rs.limit_remaining != want {
                diffs.push(format!(
                    "statuses[{i}].limit_remaining {} vs {want}",
                    rs.limit_remaining
                ));
            }
            let reset_ms = rs.duration_until_reset.as_ref().map(|t| {
                let ns = u64::try_from(t.seconds).unwrap_or(0) * 1_000_000_000
                    + u64::try_from(t.nanos).unwrap_or(0);
                ns.div_ceil(1_000_000)
            });
            if reset_ms != s.duration_until_reset_ms {
                diffs.push(format!(
                    "statuses[{i}].duration_until_reset {reset_ms:?} ms vs {:?}",
                    s.duration_until_reset_ms
                ));
            }
        }
    }
    let retry_after = r
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case("retry-after"))
        .and_then(|h| h.value.parse::<u64>().ok());
    if retry_after != d.retry_after_s {
        diffs.push(format!(
            "retry-after {retry_after:?} vs {:?}",
            d.retry_after_s
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the RLS and native answers differ: {}",
            diffs.join("; ")
        ))
    }
}
