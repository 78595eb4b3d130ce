//! pb ↔ ledger conversion: proto request → ledger command, ledger response → proto answer, for
//! the lease items (Acquire, Report, Release, Decide; unary or in a Batch, where a refused item
//! answers the [`pb::ErrorDetail`] of `errors::ledger_error`), keys, shares and status.

use super::errors::{detail, ledger_error};
use crate::ledger::{self, Command, LedgerError, Response as LResp};
use allot_proto::allot::v1 as pb;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use pb::ErrorReason;
use tonic::Status;

/// The ledger command of an Acquire request; `None` without a key.
pub fn acquire_command(b: pb::AcquireRequest) -> Option<Command> {
    Some(Command::Acquire(ledger::Acquire {
        key: policy_key(b.key).ok()?,
        region: b.region,
        holder: b.holder,
        want: b.want,
        demand_per_s: b.demand_per_s,
        want_rate_per_s: b.want_rate_per_s,
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
    in_incarnation(
        b.incarnation,
        Command::Report {
            allocation_id: b.allocation_id,
            epoch: b.epoch,
            holder: b.holder,
            cumulative_spend: b.cumulative_spend,
        },
    )
}

/// The ledger command of a Release request.
pub fn release_command(b: pb::ReleaseRequest) -> Command {
    in_incarnation(
        b.incarnation,
        Command::Release {
            allocation_id: b.allocation_id,
            epoch: b.epoch,
            holder: b.holder,
            final_spend: b.final_spend,
        },
    )
}

/// `cmd` fenced by the grant's `incarnation`; unfenced when the caller sent none (0: an older
/// agent), so it is checked as before, by id, epoch and holder only.
fn in_incarnation(incarnation: u64, cmd: Command) -> Command {
    if incarnation == 0 {
        return cmd;
    }
    Command::InIncarnation {
        incarnation,
        command: Box::new(cmd),
    }
}

/// The ledger command of one Batch item, or why it has none (nothing is applied for it).
///
/// # Errors
/// [`LedgerError::BadInput`] naming the missing `op` or `key`.
pub fn item_command(item: pb::BatchItem) -> Result<Command, LedgerError> {
    let missing = |field: &str, reason: &str| LedgerError::BadInput {
        field: field.into(),
        reason: reason.into(),
    };
    let missing_key = || missing("key", "key is required");
    match item.op {
        None => Err(missing("op", "the item has no operation")),
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
            rate_per_s: g.rate_per_s,
            promised: g.promised,
            incarnation: g.incarnation,
        }),
        LResp::Denied(d) => O::Denial(pb::Denial {
            retry_after_ms: d.retry_after_ms,
            reason: d.reason,
            policy_version: d.policy_version,
            handoff_ms: d.handoff_ms,
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
            handoff_ms: d.handoff_ms,
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

/// The result of one applied Batch item: its answer, or the detail of its refusal.
pub fn item_result(cmd: &Command, r: LResp) -> pb::BatchResult {
    let cmd = match cmd {
        Command::InIncarnation { command, .. } => command.as_ref(),
        c => c,
    };
    let outcome = match (cmd, r) {
        (_, LResp::Rejected(e)) => Outcome::Error(ledger_error(&e).1),
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

/// Proto policy key → ledger policy key.
pub fn policy_key(k: Option<pb::PolicyKey>) -> Result<ledger::PolicyKey, Status> {
    let k = k.ok_or_else(|| Status::invalid_argument("key is required"))?;
    Ok(ledger::PolicyKey {
        domain: k.domain,
        entries: k.entries.into_iter().map(|e| (e.key, e.value)).collect(),
    })
}

/// Ledger region status → proto.
pub fn region_status(r: ledger::RegionStatus) -> pb::RegionStatus {
    pb::RegionStatus {
        region: r.region,
        live_allocations: r.live_allocations,
        granted: r.granted,
        reported: r.reported,
        stranded: r.stranded,
        overshoot_bound: r.overshoot_bound,
        part_ppm: r.share_ppm,
        share_ppm: r.guarantee_ppm,
        reserved_ppm: r.reserved_ppm,
    }
}

/// Proto region shares → ledger shares.
///
/// # Errors
/// INVALID_ARGUMENT naming a region whose share is missing.
pub fn shares(shares: &[pb::RegionShare]) -> Result<Vec<ledger::ShareSpec>, Status> {
    shares
        .iter()
        .map(|s| {
            let share = match s.share {
                Some(pb::region_share::Share::FractionPpm(p)) => ledger::Share::Ppm(p),
                Some(pb::region_share::Share::AbsoluteRate(r)) => ledger::Share::Rate(r),
                None => {
                    return Err(Status::invalid_argument(format!(
                        "share of region {:?} is missing",
                        s.region
                    )))
                }
            };
            Ok(ledger::ShareSpec {
                region: s.region.clone(),
                share,
            })
        })
        .collect()
}

/// Ledger table usage → proto.
pub fn table_usage(u: &ledger::TableUsage) -> pb::TableUsage {
    pb::TableUsage {
        table: u.table.name().to_string(),
        entries: u.entries,
        refused: u.counters.refused,
        evicted: u.counters.evicted,
    }
}
