//! A failed allocator call's typed detail on the wire (issue 11 item 4). The allocator answers a
//! refused call with a gRPC status whose details (`grpc-status-details-bin`) are a
//! [`google.rpc.Status`](crate::google::rpc::Status) holding one [`ErrorDetail`]: the reason, the
//! offending field, how an allocation ended, which table is full, where the leader is. The
//! standard envelope keeps the detail readable by any gRPC tool and never confusable with other
//! bytes: before typed details, a follower sent a bare [`LeaderHint`], which has the same wire
//! shape as an `ErrorDetail`; [`leader_hint`] still reads that.

use crate::allot::v1::{ErrorDetail, ErrorReason, LeaderHint};
use crate::google::rpc;
use prost::Message;
use tonic::{Code, Status};

/// The type URL of an [`ErrorDetail`] inside `google.rpc.Status.details`.
pub const TYPE_URL: &str = "type.googleapis.com/allot.v1.ErrorDetail";

/// A status with `code`, the detail's message, and `detail` in its details.
pub fn status(code: Code, detail: &ErrorDetail) -> Status {
    let envelope = rpc::Status {
        code: code as i32,
        message: detail.message.clone(),
        details: vec![prost_types::Any {
            type_url: TYPE_URL.into(),
            value: detail.encode_to_vec(),
        }],
    };
    Status::with_details(
        code,
        detail.message.clone(),
        envelope.encode_to_vec().into(),
    )
}

/// The [`ErrorDetail`] `s` carries, `None` when it carries none (a transport failure, or an
/// allocator before typed details).
pub fn of(s: &Status) -> Option<ErrorDetail> {
    let envelope = rpc::Status::decode(s.details()).ok()?;
    envelope
        .details
        .iter()
        .find(|a| a.type_url == TYPE_URL)
        .and_then(|a| ErrorDetail::decode(a.value.as_slice()).ok())
}

/// Where the leader is when `s` says the answering node is not it and knows the leader: from a
/// NOT_LEADER [`ErrorDetail`], or from the bare [`LeaderHint`] an allocator before typed details
/// sent with FAILED_PRECONDITION. `None` for any other status, or when no leader is known.
pub fn leader_hint(s: &Status) -> Option<LeaderHint> {
    let hint = match of(s) {
        Some(d) if d.reason == ErrorReason::NotLeader as i32 => LeaderHint {
            leader_id: d.leader_id,
            leader_addr: d.leader_addr,
        },
        Some(_) => return None,
        None if s.code() == Code::FailedPrecondition && !s.details().is_empty() => {
            LeaderHint::decode(s.details()).ok()?
        }
        None => return None,
    };
    (hint.leader_id.is_some() || !hint.leader_addr.is_empty()).then_some(hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_leader(leader_id: Option<u64>, addr: &str) -> ErrorDetail {
        ErrorDetail {
            reason: ErrorReason::NotLeader as i32,
            message: "not the leader".into(),
            leader_id,
            leader_addr: addr.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_detail_round_trips_through_a_status() {
        let d = ErrorDetail {
            reason: ErrorReason::AllocationEnded as i32,
            message: "allocation 7 has ended: expired".into(),
            ended: "expired".into(),
            ..Default::default()
        };
        let s = status(Code::FailedPrecondition, &d);
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(s.message(), d.message);
        assert_eq!(of(&s), Some(d));
        // The envelope is gRPC's standard one: its code and message match the status's.
        let envelope = rpc::Status::decode(s.details()).expect("a google.rpc.Status");
        assert_eq!(envelope.code, Code::FailedPrecondition as i32);
        assert_eq!(envelope.details[0].type_url, TYPE_URL);
    }

    #[test]
    fn no_detail_without_one_and_never_from_foreign_bytes() {
        assert_eq!(of(&Status::unavailable("down")), None);
        let garbage = Status::with_details(Code::Internal, "x", vec![0xff, 0xff, 0xff].into());
        assert_eq!(of(&garbage), None);
        // A bare LeaderHint (an allocator before typed details) is not read as a detail...
        let legacy = LeaderHint {
            leader_id: Some(4),
            leader_addr: "10.0.0.4:7700".into(),
        };
        let s = Status::with_details(
            Code::FailedPrecondition,
            "not the leader",
            legacy.encode_to_vec().into(),
        );
        assert_eq!(of(&s), None);
        // ...but still as the hint it is.
        assert_eq!(leader_hint(&s), Some(legacy));
    }

    #[test]
    fn the_leader_hint_comes_from_a_not_leader_detail_only() {
        let s = status(Code::FailedPrecondition, &not_leader(Some(u64::MAX), "a:1"));
        let h = leader_hint(&s).expect("a hint");
        assert_eq!(
            (h.leader_id, h.leader_addr.as_str()),
            (Some(u64::MAX), "a:1")
        );
        // No leader known: no hint.
        assert_eq!(
            leader_hint(&status(Code::Unavailable, &not_leader(None, ""))),
            None
        );
        // Another reason with FAILED_PRECONDITION is not a hint.
        let stale = ErrorDetail {
            reason: ErrorReason::StaleEpoch as i32,
            message: "stale".into(),
            ..Default::default()
        };
        assert_eq!(leader_hint(&status(Code::FailedPrecondition, &stale)), None);
        assert_eq!(leader_hint(&Status::failed_precondition("stale")), None);
    }
}
