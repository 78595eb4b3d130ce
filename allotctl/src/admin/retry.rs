//! Admin writes that survive a leader change (issue 10 item 15): each command gets a fresh
//! request id, sent unchanged on every attempt, so a write that committed before its answer was
//! lost (the leader stepped down, the connection broke) answers its first success when retried
//! instead of failing its version precondition.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::RemoteError;
use allot_proto::allot::v1 as pb;
use allot_proto::error_detail;
use tokio::time::Instant;
use tonic::{Code, Status};

/// Pause after the first failed attempt; doubled after each further one up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// Longest pause between attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A fresh request id, uuid-shaped (8-4-4-4-12 hex digits): 128 bits from two of the standard
/// library's randomly seeded hashers over the wall time and the process id, so two commands
/// (of one process or of two) never share one.
pub fn fresh_request_id() -> String {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let word = |salt: u8| RandomState::new().hash_one((nanos, std::process::id(), salt));
    let (a, b) = (word(1), word(2));
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// Where the next attempt after the failure `s` of an attempt at `addr` goes, or `None` when
/// `s` is final. Retried: NOT_LEADER (to the leader when its address is known), UNAVAILABLE (no
/// leader yet, node down, outcome unknown), DEADLINE_EXCEEDED and CANCELLED of one attempt,
/// UNKNOWN (a broken connection), and RESOURCE_EXHAUSTED from the allocator's overloaded queue
/// (nothing applied). Everything else is the allocator's answer. The leader and the overload
/// are read from the status's typed detail ([`error_detail`]), never from its code alone.
pub fn retry_at(s: &Status, addr: &str) -> Option<String> {
    if let Some(hint) = error_detail::leader_hint(s) {
        let leader = hint.leader_addr;
        return Some(if leader.is_empty() {
            addr.to_string()
        } else {
            leader
        });
    }
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            Some(addr.to_string())
        }
        Code::ResourceExhausted if overloaded(s) => Some(addr.to_string()),
        _ => None,
    }
}

/// Whether `s` carries the ErrorDetail OVERLOADED (refused unapplied by the group commit).
fn overloaded(s: &Status) -> bool {
    error_detail::of(s).is_some_and(|d| d.reason == pb::ErrorReason::Overloaded as i32)
}

/// Why one attempt failed.
#[derive(Debug)]
pub enum Failure {
    /// No connection to the node could be made: nothing was sent (retried at the same node).
    Connect(anyhow::Error),
    /// The call was sent and answered (or broken) with this status.
    Remote(Status),
}

impl Failure {
    /// Where the next attempt goes after this failure at `addr`; `None` when it is final.
    fn retry_at(&self, addr: &str) -> Option<String> {
        match self {
            Failure::Connect(_) => Some(addr.to_string()),
            Failure::Remote(s) => retry_at(s, addr),
        }
    }

    /// The error to report: the allocator's answer as a [`RemoteError`], a connection failure
    /// as a local error.
    pub fn into_error(self) -> anyhow::Error {
        match self {
            Failure::Connect(e) => e,
            Failure::Remote(s) => RemoteError(s).into(),
        }
    }
}

/// Runs `call(addr, time left)` until it succeeds, fails with a final error, or `timeout` has
/// passed, pausing between attempts (from [`FIRST_BACKOFF`], doubling, at most
/// [`MAX_BACKOFF`]) and following leader hints. The caller sends the same request id in every
/// attempt.
///
/// # Errors
/// The final failure, or the last retryable one when no time is left for another attempt.
pub async fn with_retries<T, F, Fut>(
    addr: &str,
    timeout: Duration,
    mut call: F,
) -> Result<T, Failure>
where
    F: FnMut(String, Duration) -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let deadline = Instant::now() + timeout;
    let mut addr = addr.to_string();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = match call(addr.clone(), left).await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let Some(next) = e.retry_at(&addr) else {
            return Err(e);
        };
        if Instant::now() + backoff >= deadline {
            return Err(e);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        addr = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use std::sync::Mutex;

    fn not_leader(addr: &str) -> Status {
        let hint = pb::LeaderHint {
            leader_id: Some(2),
            leader_addr: addr.into(),
        };
        Status::with_details(
            Code::FailedPrecondition,
            "not the leader",
            hint.encode_to_vec().into(),
        )
    }

    #[test]
    fn request_ids_are_fresh_and_uuid_shaped() {
        let (a, b) = (fresh_request_id(), fresh_request_id());
        assert_ne!(a, b);
        let groups: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(groups, vec![8, 4, 4, 4, 12], "{a}");
        assert!(a.chars().all(|c| c == '-' || c.is_ascii_hexdigit()), "{a}");
    }

    /// A write whose first attempts meet no leader, then a follower that cannot forward, is
    /// sent again with its one id, to the leader the hint names, until it succeeds.
    #[tokio::test]
    async fn a_write_is_retried_with_its_one_id_and_follows_the_leader_hint() {
        let id = fresh_request_id();
        let sent = Mutex::new(Vec::new());
        let mut answers = vec![
            Err(Failure::Remote(Status::unavailable(
                "no leader is known yet",
            ))),
            Err(Failure::Remote(not_leader("10.0.0.2:7000"))),
            Err(Failure::Connect(anyhow::anyhow!("connection refused"))),
            Err(Failure::Remote(Status::unknown("connection reset"))),
            Ok(7u64),
        ]
        .into_iter();
        let r = with_retries("10.0.0.1:7000", Duration::from_secs(10), |addr, left| {
            // What a command sends: its request carries the id chosen once for it.
            sent.lock().unwrap().push((addr, id.clone()));
            assert!(left > Duration::ZERO);
            let answer = answers.next().expect("no attempt after the success");
            async move { answer }
        })
        .await;
        assert_eq!(r.expect("the last attempt succeeds"), 7);
        let sent = sent.into_inner().unwrap();
        let addrs: Vec<&str> = sent.iter().map(|(a, _)| a.as_str()).collect();
        assert_eq!(
            addrs,
            [
                "10.0.0.1:7000",
                "10.0.0.1:7000",
                "10.0.0.2:7000",
                "10.0.0.2:7000",
                "10.0.0.2:7000"
            ]
        );
        assert!(
            sent.iter().all(|(_, i)| !i.is_empty() && *i == id),
            "{sent:?}"
        );
    }

    #[tokio::test]
    async fn the_allocators_answers_are_final() {
        for e in [
            Status::failed_precondition("domain \"api\" is at version 1, not 0"),
            Status::invalid_argument("bad yaml"),
            Status::not_found("no policy named \"x\""),
            Status::resource_exhausted("table keys: full"),
        ] {
            let mut attempts = 0;
            let r: Result<(), Failure> = with_retries("a:1", Duration::from_secs(10), |_, _| {
                attempts += 1;
                let e = e.clone();
                async move { Err(Failure::Remote(e)) }
            })
            .await;
            let Err(Failure::Remote(got)) = r else {
                panic!("expected the allocator's answer, got {r:?}");
            };
            assert_eq!((got.code(), attempts), (e.code(), 1));
        }
        let typed = |code, reason: pb::ErrorReason, leader_addr: &str| {
            let d = pb::ErrorDetail {
                reason: reason as i32,
                message: "m".into(),
                leader_id: (!leader_addr.is_empty()).then_some(2),
                leader_addr: leader_addr.into(),
                ..Default::default()
            };
            error_detail::status(code, &d)
        };
        let s = typed(Code::ResourceExhausted, pb::ErrorReason::Overloaded, "");
        assert_eq!(retry_at(&s, "a:1").as_deref(), Some("a:1"));
        // A typed refusal with FAILED_PRECONDITION is final, never read as a leader hint.
        let s = typed(
            Code::FailedPrecondition,
            pb::ErrorReason::VersionMismatch,
            "",
        );
        assert_eq!(retry_at(&s, "a:1"), None);
        let s = typed(Code::FailedPrecondition, pb::ErrorReason::NotLeader, "b:2");
        assert_eq!(retry_at(&s, "a:1").as_deref(), Some("b:2"));
    }

    /// With no leader ever, attempts stop once the next pause would pass the deadline, and
    /// the last error is returned.
    #[tokio::test]
    async fn retries_stop_at_the_deadline() {
        let mut attempts = 0;
        let r: Result<(), Failure> = with_retries("a:1", Duration::from_millis(120), |_, _| {
            attempts += 1;
            async { Err(Failure::Remote(Status::unavailable("no leader"))) }
        })
        .await;
        assert!(
            matches!(&r, Err(Failure::Remote(s)) if s.code() == Code::Unavailable),
            "{r:?}"
        );
        // Every pause is at least its backoff (50 ms, then 100 ms): a third attempt would start
        // after 150 ms, past the deadline, however slow the machine.
        assert!((1..=2).contains(&attempts), "{attempts}");
    }
}
