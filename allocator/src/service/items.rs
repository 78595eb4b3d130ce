//! The lease items of the API (Acquire, Report, Release, Decide), unary or in a Batch: proto
//! request → ledger command, ledger response → proto answer, and the one mapping of a refused
//! item to its [`pb::ErrorDetail`].

use super::policy_key;
use crate::ledger::{self, AllocationState, Command, Ledger, LedgerError, Response as LResp};
use allot_proto::allot::v1 as pb;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use pb::ErrorReason;

/// An ErrorDetail with `reason` and `message`, other fields empty.
pub fn detail(reason: ErrorReason, message: impl Into<String>) -> pb::ErrorDetail {
    pb::ErrorDetail {
        reason: reason as i32,
        message: message.into(),
        ..Default::default()
    }
}

fn bad_input(field: &str, message: &str) -> pb::ErrorDetail {
    pb::ErrorDetail {
        field: field.into(),
        ..detail(ErrorReason::BadInput, message)
    }
}

/// The ledger command of an Acquire request; `None` without a key.
pub fn acquire_command(b: pb::AcquireRequest) -> Option<Command> {
    Some(Command::Acquire(ledger::Acquire {
        key: policy_key(b.key).ok()?,
        region: b.region,
        holder: b.holder,
        want: b.want,
        demand_per_s: b.demand_per_s,
        request_id: b.request_id,
    }))
}

/// The ledger command of a Decide request; `None` without a key.
pub fn decide_command(b: pb::DecideRequest) -> Option<Command> {
    Some(Command::Decide(ledger::Decide {
        key: policy_key(b.key).ok()?,
        region: b.region,
        holder: b.holder,
        cost: b.cost,
        request_id: b.request_id,
    }))
}

/// The ledger command of a Report request.
pub fn report_command(b: pb::ReportRequest) -> Command {
    Command::Report {
        allocation_id: b.allocation_id,
        epoch: b.epoch,
        holder: b.holder,
        cumulative_spend: b.cumulative_spend,
    }
}

/// The ledger command of a Release request.
pub fn release_command(b: pb::ReleaseRequest) -> Command {
    Command::Release {
        allocation_id: b.allocation_id,
        epoch: b.epoch,
        holder: b.holder,
        final_spend: b.final_spend,
    }
}

/// The ledger command of one Batch item, or why it has none (nothing is applied for it).
pub fn item_command(item: pb::BatchItem) -> Result<Command, pb::ErrorDetail> {
    let missing_key = || bad_input("key", "key is required");
    match item.op {
        None => Err(bad_input("op", "the item has no operation")),
        Some(Op::Acquire(b)) => acquire_command(b).ok_or_else(missing_key),
        Some(Op::Decide(b)) => decide_command(b).ok_or_else(missing_key),
        Some(Op::Report(b)) => Ok(report_command(b)),
        Some(Op::Release(b)) => Ok(release_command(b)),
    }
}

/// An Acquire's answer, or the response when it is not one.
pub fn acquire_response(r: LResp) -> Result<pb::AcquireResponse, LResp> {
    use pb::acquire_response::Outcome as O;
    let outcome = match r {
        LResp::Granted(g) => O::Grant(pb::Grant {
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            granted: g.granted,
            expires_at_unix_ms: g.expires_at_ms,
            ttl_ms: g.expires_at_ms.saturating_sub(g.issued_at_ms),
            policy_version: g.policy_version,
        }),
        LResp::Denied(d) => O::Denial(pb::Denial {
            retry_after_ms: d.retry_after_ms,
            reason: d.reason,
            policy_version: d.policy_version,
        }),
        other => return Err(other),
    };
    Ok(pb::AcquireResponse {
        outcome: Some(outcome),
    })
}

/// A Decide's answer, or the response when it is not one.
pub fn decide_response(r: LResp) -> Result<pb::DecideResponse, LResp> {
    match r {
        LResp::Decided(d) => Ok(pb::DecideResponse {
            allowed: d.allowed,
            remaining: d.remaining,
            retry_after_ms: d.retry_after_ms,
            never: d.never,
            reason: d.reason,
            policy_version: d.policy_version,
        }),
        other => Err(other),
    }
}

/// A Report's answer, or the response when it is not one.
pub fn report_response(r: LResp) -> Result<pb::ReportResponse, LResp> {
    match r {
        LResp::Reported {
            recorded,
            expires_at_ms,
        } => Ok(pb::ReportResponse {
            recorded_spend: recorded,
            expires_at_unix_ms: expires_at_ms,
        }),
        other => Err(other),
    }
}

/// A Release's answer, or the response when it is not one.
pub fn release_response(r: LResp) -> Result<pb::ReleaseResponse, LResp> {
    match r {
        LResp::Released { returned } => Ok(pb::ReleaseResponse { returned }),
        other => Err(other),
    }
}

/// The result of one applied Batch item: its answer, or the detail of its refusal. `facts`
/// looks an allocation up in the applied state, to classify a refused Report or Release.
pub fn item_result(
    cmd: &Command,
    r: LResp,
    facts: impl FnOnce(u64) -> AllocationFacts,
) -> pb::BatchResult {
    let outcome = match (cmd, r) {
        (_, LResp::Rejected(e)) => Outcome::Error(error_detail(&e, cmd, facts)),
        (Command::Acquire(_), r) => acquire_response(r)
            .map(Outcome::Acquire)
            .unwrap_or_else(unexpected),
        (Command::Decide(_), r) => decide_response(r)
            .map(Outcome::Decide)
            .unwrap_or_else(unexpected),
        (Command::Report { .. }, r) => report_response(r)
            .map(Outcome::Report)
            .unwrap_or_else(unexpected),
        (Command::Release { .. }, r) => release_response(r)
            .map(Outcome::Release)
            .unwrap_or_else(unexpected),
        (_, r) => unexpected(r),
    };
    pb::BatchResult {
        outcome: Some(outcome),
    }
}

fn unexpected(r: LResp) -> Outcome {
    Outcome::Error(detail(
        ErrorReason::Unspecified,
        format!("unexpected ledger response {r:?}"),
    ))
}

/// What the applied state says about one allocation: (epoch, state), `None` when unknown.
/// Read with [`allocation_facts`].
pub type AllocationFacts = Option<(u64, AllocationState)>;

/// The one mapping of a ledger refusal to the wire's [`pb::ErrorDetail`] (the Batch items'
/// errors). `cmd` is the refused command. A refused Report or Release is classified by the
/// allocation's state, looked up by `facts` after the refusal: an allocation's epoch never
/// changes and its end (released, expired) is final, so that state tells why it was refused.
pub fn error_detail(
    e: &LedgerError,
    cmd: &Command,
    facts: impl FnOnce(u64) -> AllocationFacts,
) -> pb::ErrorDetail {
    let message = e.to_string();
    let allocation = match cmd {
        Command::Report {
            allocation_id,
            epoch,
            ..
        }
        | Command::Release {
            allocation_id,
            epoch,
            ..
        } => Some((*allocation_id, *epoch)),
        _ => None,
    };
    let reason = match (e, allocation) {
        (LedgerError::InvalidArgument(_), _) => ErrorReason::BadInput,
        (LedgerError::NotFound(_), Some(_)) => ErrorReason::UnknownAllocation,
        (LedgerError::NotFound(_), None) => ErrorReason::UnknownPolicy,
        (LedgerError::ResourceExhausted(_), _) => ErrorReason::KeyCapReached,
        (LedgerError::FailedPrecondition(_), Some((id, epoch))) => {
            let ended = match facts(id) {
                Some((e, AllocationState::Released { .. })) if e == epoch => "released",
                Some((e, AllocationState::Expired)) if e == epoch => "expired",
                _ => return detail(ErrorReason::StaleEpoch, message),
            };
            return pb::ErrorDetail {
                ended: ended.into(),
                ..detail(ErrorReason::AllocationEnded, message)
            };
        }
        (LedgerError::FailedPrecondition(_), None) => match cmd {
            Command::PutPolicy { .. } | Command::SetShares { .. } => ErrorReason::VersionMismatch,
            _ => ErrorReason::ScopeLocal,
        },
    };
    detail(reason, message)
}

/// [`AllocationFacts`] of allocation `id` in `ledger`.
pub fn allocation_facts(ledger: &Ledger, id: u64) -> AllocationFacts {
    ledger.allocation(id).map(|a| (a.epoch, a.state))
}
