//! Errors on the wire (issue 11 item 4). [`ledger_error`] is the one mapping of a ledger refusal:
//! each [`LedgerError`] variant gets its gRPC code and a machine-readable [`pb::ErrorDetail`]
//! (reason, offending field, how an allocation ended, which table is full). A unary call answers
//! the code with the detail in its status details ([`error_detail`]); a Batch item answers the
//! detail as its result. Not the leader, overload and passed deadlines get their detail here too.

use crate::ledger::{LedgerError, Response as LResp};
use crate::raft::{ClientError, CommitError};
use allot_proto::allot::v1 as pb;
use allot_proto::error_detail;
use pb::ErrorReason;
use tonic::{Code, Status};

/// An ErrorDetail with `reason` and `message`, other fields empty.
pub fn detail(reason: ErrorReason, message: impl Into<String>) -> pb::ErrorDetail {
    pb::ErrorDetail {
        reason: reason as i32,
        message: message.into(),
        ..Default::default()
    }
}

/// A BAD_INPUT detail naming the offending `field`.
fn bad_input(field: &str, message: impl Into<String>) -> pb::ErrorDetail {
    pb::ErrorDetail {
        field: field.into(),
        ..detail(ErrorReason::BadInput, message)
    }
}

/// The gRPC code and the wire detail of a ledger refusal. The message is the error's text; the
/// reason and its structured fields are what a client acts on.
pub fn ledger_error(e: &LedgerError) -> (Code, pb::ErrorDetail) {
    use LedgerError as E;
    let message = e.to_string();
    let with = |reason| detail(reason, message.clone());
    match e {
        E::BadInput { field, .. } => (Code::InvalidArgument, bad_input(field, message)),
        E::RequestIdReused { .. } | E::AdminRequestIdReused { .. } => {
            (Code::InvalidArgument, bad_input("request_id", message))
        }
        E::LimitNameTaken { .. } => (Code::InvalidArgument, bad_input("yaml", message)),
        E::SharesOverfull { .. } => (Code::InvalidArgument, bad_input("shares", message)),
        E::Unlimited { .. } => (Code::InvalidArgument, bad_input("key", message)),
        E::NeverGrantable { .. } => (Code::InvalidArgument, with(ErrorReason::NeverGrantable)),
        E::UnknownDomain { .. }
        | E::NoMatchingLimit { .. }
        | E::UnknownPolicy { .. }
        | E::UnknownRegion { .. }
        | E::NoKeyState { .. } => (Code::NotFound, with(ErrorReason::UnknownPolicy)),
        E::UnknownAllocation { .. } => (Code::NotFound, with(ErrorReason::UnknownAllocation)),
        // A stale incarnation is a stale epoch on the wire: the caller holds an allocation this
        // ledger did not grant, and drops it (design §3, §4).
        E::StaleEpoch { .. } | E::StaleIncarnation { .. } => {
            (Code::FailedPrecondition, with(ErrorReason::StaleEpoch))
        }
        E::NotHolder { .. } => (Code::FailedPrecondition, with(ErrorReason::NotHolder)),
        E::AllocationEnded { how, .. } => (
            Code::FailedPrecondition,
            pb::ErrorDetail {
                ended: how.as_str().into(),
                ..with(ErrorReason::AllocationEnded)
            },
        ),
        E::PolicyVersionMismatch { .. } | E::SharesVersionNotNewer { .. } => {
            (Code::FailedPrecondition, with(ErrorReason::VersionMismatch))
        }
        E::ScopeLocal { .. } => (Code::FailedPrecondition, with(ErrorReason::ScopeLocal)),
        E::TableFull { table, .. } => (
            Code::ResourceExhausted,
            pb::ErrorDetail {
                table: table.name().into(),
                ..with(ErrorReason::KeyCapReached)
            },
        ),
    }
}

/// FAILED_PRECONDITION carrying where the leader is; UNAVAILABLE while no leader is known (an
/// election is running), since only a retry later can help then. Either carries a NOT_LEADER
/// [`pb::ErrorDetail`] (with the leader's id and address when known) in its details.
pub(super) fn not_leader(leader_id: Option<u64>, leader_addr: Option<String>) -> Status {
    let Some(id) = leader_id else {
        let d = detail(
            pb::ErrorReason::NotLeader,
            "not the leader, and no leader is known yet; retry shortly",
        );
        return error_detail::status(Code::Unavailable, &d);
    };
    let d = pb::ErrorDetail {
        leader_id: Some(id),
        leader_addr: leader_addr.clone().unwrap_or_default(),
        ..detail(
            pb::ErrorReason::NotLeader,
            format!(
                "not the leader; leader is {id} at {}",
                leader_addr.as_deref().unwrap_or("unknown")
            ),
        )
    };
    error_detail::status(Code::FailedPrecondition, &d)
}

/// The ErrorDetail of a call refused unapplied by the group commit.
pub(super) fn commit_detail(e: &CommitError) -> pb::ErrorDetail {
    let reason = match e {
        CommitError::Overloaded { .. } => pb::ErrorReason::Overloaded,
        CommitError::DeadlineExceeded => pb::ErrorReason::DeadlineExceeded,
        CommitError::Client(_) => pb::ErrorReason::Unspecified,
    };
    detail(reason, e.to_string())
}

/// The status of a failed commit (not-leader forwarding is the caller's).
pub(super) fn commit_status(e: CommitError) -> Status {
    match e {
        CommitError::Overloaded { .. } => {
            error_detail::status(Code::ResourceExhausted, &commit_detail(&e))
        }
        CommitError::DeadlineExceeded => {
            error_detail::status(Code::DeadlineExceeded, &commit_detail(&e))
        }
        CommitError::Client(ClientError::NotLeader {
            leader_id,
            leader_addr,
        }) => not_leader(leader_id, leader_addr),
        // Raft stopped under the write: it may or may not have committed.
        CommitError::Client(e) => Status::unavailable(format!("write outcome unknown: {e}")),
    }
}

/// The status of a unary call the ledger refused: the code and, in its details, the
/// [`pb::ErrorDetail`] of [`ledger_error`].
pub(super) fn ledger_status(e: LedgerError) -> Status {
    let (code, d) = ledger_error(&e);
    error_detail::status(code, &d)
}

/// The status of a ledger response of another kind than the call expects.
pub(super) fn unexpected(r: LResp) -> Status {
    match r {
        LResp::Rejected(e) => ledger_status(e),
        other => Status::internal(format!("unexpected ledger response {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Ended, Table};

    /// One of every variant, with the code and detail each must map to.
    fn every_variant() -> Vec<(LedgerError, Code, ErrorReason)> {
        use LedgerError as E;
        let s = |v: &str| v.to_string();
        vec![
            (
                E::BadInput {
                    field: s("want"),
                    reason: s("must be > 0"),
                },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
            (
                E::UnknownDomain { domain: s("api") },
                Code::NotFound,
                ErrorReason::UnknownPolicy,
            ),
            (
                E::NoMatchingLimit { domain: s("api") },
                Code::NotFound,
                ErrorReason::UnknownPolicy,
            ),
            (
                E::UnknownPolicy { policy: s("p") },
                Code::NotFound,
                ErrorReason::UnknownPolicy,
            ),
            (
                E::UnknownRegion {
                    policy: s("p"),
                    region: s("mars"),
                },
                Code::NotFound,
                ErrorReason::UnknownPolicy,
            ),
            (
                E::NoKeyState { policy: s("p") },
                Code::NotFound,
                ErrorReason::UnknownPolicy,
            ),
            (
                E::UnknownAllocation { id: u64::MAX },
                Code::NotFound,
                ErrorReason::UnknownAllocation,
            ),
            (
                E::StaleEpoch {
                    id: 1,
                    have: u64::MAX,
                    got: 0,
                },
                Code::FailedPrecondition,
                ErrorReason::StaleEpoch,
            ),
            (
                E::StaleIncarnation {
                    id: 1,
                    have: 2,
                    got: 1,
                },
                Code::FailedPrecondition,
                ErrorReason::StaleEpoch,
            ),
            (
                E::NotHolder {
                    id: 1,
                    holder: s("gw2"),
                },
                Code::FailedPrecondition,
                ErrorReason::NotHolder,
            ),
            (
                E::AllocationEnded {
                    id: 1,
                    how: Ended::Expired,
                },
                Code::FailedPrecondition,
                ErrorReason::AllocationEnded,
            ),
            (
                E::PolicyVersionMismatch {
                    domain: s("api"),
                    expected: 0,
                    actual: u64::MAX,
                },
                Code::FailedPrecondition,
                ErrorReason::VersionMismatch,
            ),
            (
                E::SharesVersionNotNewer {
                    policy: s("p"),
                    current: 3,
                    got: 3,
                },
                Code::FailedPrecondition,
                ErrorReason::VersionMismatch,
            ),
            (
                E::ScopeLocal { policy: s("p") },
                Code::FailedPrecondition,
                ErrorReason::ScopeLocal,
            ),
            (
                E::Unlimited { policy: s("p") },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
            (
                E::LimitNameTaken { name: s("p") },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
            (
                E::NeverGrantable {
                    policy: s("p"),
                    region: s("eu"),
                    share_ppm: 1,
                    least_ppm: 2,
                    capacity_tokens: 0,
                },
                Code::InvalidArgument,
                ErrorReason::NeverGrantable,
            ),
            (
                E::SharesOverfull {
                    policy: s("p"),
                    total_ppm: u64::MAX,
                },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
            (
                E::TableFull {
                    table: Table::PolicyKeys { policy: s("p") },
                    cap: 0,
                },
                Code::ResourceExhausted,
                ErrorReason::KeyCapReached,
            ),
            (
                E::RequestIdReused {
                    holder: s("h"),
                    request_id: s("r"),
                    kind: s("acquire"),
                },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
            (
                E::AdminRequestIdReused {
                    request_id: s("put-1"),
                },
                Code::InvalidArgument,
                ErrorReason::BadInput,
            ),
        ]
    }

    #[test]
    fn every_variant_maps_to_its_code_and_reason_with_its_facts() {
        for (e, code, reason) in every_variant() {
            let (c, d) = ledger_error(&e);
            assert_eq!((c, d.reason), (code, reason as i32), "{e:?}");
            assert_eq!(d.message, e.to_string());
            match &e {
                LedgerError::BadInput { field, .. } => assert_eq!(&d.field, field),
                LedgerError::RequestIdReused { .. } | LedgerError::AdminRequestIdReused { .. } => {
                    assert_eq!(d.field, "request_id")
                }
                LedgerError::AllocationEnded { how, .. } => assert_eq!(d.ended, how.as_str()),
                LedgerError::TableFull { .. } => assert_eq!(d.table, "policy_keys"),
                _ => assert!(d.ended.is_empty() && d.table.is_empty()),
            }
            assert_eq!(d.leader_id, None);
        }
    }
}
