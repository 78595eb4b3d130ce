//! The agent's link to the allocator cluster: any node answers (followers forward to the
//! leader), so calls rotate through the configured endpoints on failure and follow a leader hint
//! when a node gives one. Every call is bounded by a timeout.
//!
//! Every failure is classified here, once, into a [`CallError`] (issue 11 item 4): from the
//! allocator's typed [`pb::ErrorDetail`] when it sent one (in the status details of a unary call,
//! or as a Batch item's result), else from the gRPC code. The lease manager acts on that enum,
//! never on codes or message text.

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use allot_proto::error_detail;
use parking_lot::Mutex;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// Why the link could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// No endpoint was given.
    #[error("no allocator endpoint configured")]
    NoEndpoints,
    /// An endpoint is not a valid URI.
    #[error("allocator endpoint {0:?} is not a valid address: {1}")]
    BadEndpoint(String, String),
}

/// Makes a lazily connecting channel to an allocator address ("host:port" or a URI), calls
/// bounded by the given timeout: plain TCP ([`tcp_channel`]) unless a simulation supplies its
/// network (issue 12 item 1).
pub type Connect = Arc<dyn Fn(&str, Duration) -> Result<Channel, LinkError> + Send + Sync>;

/// Connections to the allocator nodes.
pub struct AllocatorLink {
    endpoints: Vec<(String, Channel)>,
    current: AtomicUsize,
    hinted: Mutex<Option<(String, Channel)>>,
    timeout: Duration,
    connect: Connect,
}

impl std::fmt::Debug for AllocatorLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocatorLink")
            .field(
                "endpoints",
                &self.endpoints.iter().map(|e| &e.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A plain TCP channel to `addr` ("host:port" or a URI), connecting on first use; connects and
/// calls time out after `timeout`.
///
/// # Errors
/// [`LinkError::BadEndpoint`] when `addr` is not a valid URI.
pub fn tcp_channel(addr: &str, timeout: Duration) -> Result<Channel, LinkError> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)
        .map_err(|e| LinkError::BadEndpoint(addr.to_string(), e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .tcp_nodelay(true)
        .connect_lazy())
}

/// Why the allocator no longer holds an allocation as live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Its epoch is not the allocator's (STALE_EPOCH).
    StaleEpoch,
    /// It was released or expired (ALLOCATION_ENDED); `how` is the allocator's word for it:
    /// "released", "expired" or "forgotten".
    Ended {
        /// How it ended.
        how: String,
    },
    /// Another holder holds it (NOT_HOLDER).
    NotHolder,
    /// The allocator never granted it (UNKNOWN_ALLOCATION).
    UnknownAllocation,
    /// An allocator without typed details refused it (FAILED_PRECONDITION or NOT_FOUND).
    Unspecified,
}

/// Why a call to the allocator failed, classified once ([`CallError::from_status`],
/// [`CallError::from_detail`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The allocator no longer holds the allocation as live: drop it, nothing to retry.
    #[error("allocation fenced ({why:?}): {message}")]
    Fenced {
        /// Why.
        why: Fence,
        /// The allocator's message.
        message: String,
    },
    /// The answering node is not the leader and could not forward; where the leader is, when
    /// it is known. Retry (the link follows the hint).
    #[error("not the leader (leader {leader_id:?} at {leader_addr:?})")]
    NotLeader {
        /// The leader's node id.
        leader_id: Option<u64>,
        /// The leader's address.
        leader_addr: Option<String>,
    },
    /// No node answered in time (unavailable, timed out, transport failure); retry later.
    #[error("allocator unreachable: {message}")]
    Unreachable {
        /// What failed.
        message: String,
    },
    /// The allocator refused the work unapplied (its queue was full, or the call's deadline
    /// passed while queued); retry after a backoff.
    #[error("allocator overloaded, nothing applied: {message}")]
    Overloaded {
        /// The allocator's message.
        message: String,
    },
    /// Refused for good: bad input, unknown policy, a full table, a version mismatch, …;
    /// retrying the same request cannot succeed.
    #[error("refused ({reason:?}, field {field:?}): {message}")]
    Rejected {
        /// The allocator's reason (UNSPECIFIED when it gave none).
        reason: pb::ErrorReason,
        /// The offending field, for BAD_INPUT.
        field: String,
        /// The allocator's message.
        message: String,
    },
    /// The allocator does not serve this call (UNIMPLEMENTED: an older version).
    #[error("the allocator does not serve this call")]
    Unsupported,
}

impl CallError {
    /// The class of a typed detail: the allocator's reason decides, never its text. A reason
    /// this agent does not know (a newer allocator) is a rejection.
    pub fn from_detail(d: &pb::ErrorDetail) -> Self {
        use pb::ErrorReason as R;
        let fenced = |why| CallError::Fenced {
            why,
            message: d.message.clone(),
        };
        let reason = R::try_from(d.reason).unwrap_or(R::Unspecified);
        match reason {
            R::StaleEpoch => fenced(Fence::StaleEpoch),
            R::AllocationEnded => fenced(Fence::Ended {
                how: d.ended.clone(),
            }),
            R::NotHolder => fenced(Fence::NotHolder),
            R::UnknownAllocation => fenced(Fence::UnknownAllocation),
            R::NotLeader => CallError::NotLeader {
                leader_id: d.leader_id,
                leader_addr: Some(d.leader_addr.clone()).filter(|a| !a.is_empty()),
            },
            R::Overloaded | R::DeadlineExceeded => CallError::Overloaded {
                message: d.message.clone(),
            },
            R::Unspecified
            | R::BadInput
            | R::UnknownPolicy
            | R::VersionMismatch
            | R::KeyCapReached
            | R::ScopeLocal
            | R::NeverGrantable => CallError::Rejected {
                reason,
                field: d.field.clone(),
                message: d.message.clone(),
            },
        }
    }

    /// The class of a failed call's status: its typed detail when the allocator attached one,
    /// else (a transport failure, or an allocator without typed details) its code.
    pub fn from_status(s: &Status) -> Self {
        if s.code() == Code::Unimplemented {
            return CallError::Unsupported;
        }
        if let Some(d) = error_detail::of(s) {
            return CallError::from_detail(&d);
        }
        if let Some(h) = error_detail::leader_hint(s) {
            return CallError::NotLeader {
                leader_id: h.leader_id,
                leader_addr: Some(h.leader_addr).filter(|a| !a.is_empty()),
            };
        }
        let message = s.message().to_string();
        match s.code() {
            Code::FailedPrecondition | Code::NotFound => CallError::Fenced {
                why: Fence::Unspecified,
                message,
            },
            Code::ResourceExhausted => CallError::Overloaded { message },
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Unknown
            | Code::Cancelled
            | Code::Internal
            | Code::Aborted => CallError::Unreachable { message },
            _ => CallError::Rejected {
                reason: pb::ErrorReason::Unspecified,
                field: String::new(),
                message,
            },
        }
    }

    /// The allocator could not do the work now (no leader, unreachable, overloaded): keep what
    /// is held and retry later. Every other class is an answer from a working allocator.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            CallError::NotLeader { .. }
                | CallError::Unreachable { .. }
                | CallError::Overloaded { .. }
        )
    }
}

impl AllocatorLink {
    /// A link to `endpoints` ("host:port"); calls time out after `timeout`. Connects lazily.
    ///
    /// # Errors
    /// [`LinkError`] for an empty list or an unparsable address.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Self, LinkError> {
        Self::with_connect(endpoints, timeout, Arc::new(tcp_channel))
    }

    /// [`AllocatorLink::new`] making its channels (to the endpoints and to hinted leaders)
    /// with `connect`.
    ///
    /// # Errors
    /// [`LinkError`] for an empty list, or what `connect` returns.
    pub fn with_connect(
        endpoints: &[String],
        timeout: Duration,
        connect: Connect,
    ) -> Result<Self, LinkError> {
        if endpoints.is_empty() {
            return Err(LinkError::NoEndpoints);
        }
        let endpoints = endpoints
            .iter()
            .map(|a| Ok((a.clone(), connect(a, timeout)?)))
            .collect::<Result<Vec<_>, LinkError>>()?;
        Ok(AllocatorLink {
            endpoints,
            current: AtomicUsize::new(0),
            hinted: Mutex::new(None),
            timeout,
            connect,
        })
    }

    /// Runs `call` against the current node, then the others, until one answers with something
    /// other than a transport failure or "not the leader"; follows a leader hint at once. A
    /// timed-out Acquire is retried with the same request id, so the allocator never charges it
    /// twice.
    ///
    /// # Errors
    /// The classified failure: the last node's when none answered, else the first answer that
    /// is not worth another node.
    pub async fn call<T, F, Fut>(&self, call: F) -> Result<T, CallError>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut last = CallError::Unreachable {
            message: "no allocator endpoint answered".into(),
        };
        let hinted = self.hinted.lock().clone();
        if let Some((_, ch)) = hinted {
            match self.once(&call, ch).await {
                Ok(v) => return Ok(v),
                Err(e) if another_node_may_answer(&e) => {
                    *self.hinted.lock() = None;
                    last = e;
                }
                Err(e) => return Err(e),
            }
        }
        let n = self.endpoints.len();
        let start = self.current.load(Ordering::Relaxed);
        for i in 0..n {
            let idx = (start + i) % n;
            match self.once(&call, self.endpoints[idx].1.clone()).await {
                Ok(v) => {
                    self.current.store(idx, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(CallError::NotLeader {
                    leader_id,
                    leader_addr: Some(addr),
                }) => {
                    // A follower that could not forward names the leader: go there next.
                    if let Some(v) = self.follow(&call, &addr).await {
                        return Ok(v);
                    }
                    last = CallError::NotLeader {
                        leader_id,
                        leader_addr: Some(addr),
                    };
                }
                Err(e) if another_node_may_answer(&e) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Runs `call` against the hinted leader at `addr`, remembered for the next calls.
    async fn follow<T, F, Fut>(&self, call: &F, addr: &str) -> Option<T>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let ch = (self.connect)(addr, self.timeout).ok()?;
        *self.hinted.lock() = Some((addr.to_string(), ch.clone()));
        self.once(call, ch).await.ok()
    }

    async fn once<T, F, Fut>(&self, call: &F, ch: Channel) -> Result<T, CallError>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        match tokio::time::timeout(self.timeout, call(AllocatorClient::new(ch))).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(CallError::from_status(&s)),
            Err(_) => Err(CallError::Unreachable {
                message: "allocator call timed out".into(),
            }),
        }
    }
}

/// Whether another node might answer where this one failed: it was unreachable, or is not the
/// leader (with no hint to follow).
fn another_node_may_answer(e: &CallError) -> bool {
    matches!(
        e,
        CallError::Unreachable { .. } | CallError::NotLeader { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::ErrorReason as R;
    use prost::Message;

    fn detail(reason: R) -> pb::ErrorDetail {
        pb::ErrorDetail {
            reason: reason as i32,
            message: "m".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_reason_has_one_class() {
        let fenced = |why| CallError::Fenced {
            why,
            message: "m".into(),
        };
        let rejected = |reason| CallError::Rejected {
            reason,
            field: String::new(),
            message: "m".into(),
        };
        let overloaded = CallError::Overloaded {
            message: "m".into(),
        };
        let cases = [
            (R::StaleEpoch, fenced(Fence::StaleEpoch)),
            (R::NotHolder, fenced(Fence::NotHolder)),
            (R::UnknownAllocation, fenced(Fence::UnknownAllocation)),
            (R::Overloaded, overloaded.clone()),
            (R::DeadlineExceeded, overloaded),
            (R::Unspecified, rejected(R::Unspecified)),
            (R::BadInput, rejected(R::BadInput)),
            (R::UnknownPolicy, rejected(R::UnknownPolicy)),
            (R::VersionMismatch, rejected(R::VersionMismatch)),
            (R::KeyCapReached, rejected(R::KeyCapReached)),
            (R::ScopeLocal, rejected(R::ScopeLocal)),
            (R::NeverGrantable, rejected(R::NeverGrantable)),
        ];
        for (reason, want) in cases {
            assert_eq!(CallError::from_detail(&detail(reason)), want, "{reason:?}");
        }
        let ended = pb::ErrorDetail {
            ended: "expired".into(),
            ..detail(R::AllocationEnded)
        };
        assert_eq!(
            CallError::from_detail(&ended),
            fenced(Fence::Ended {
                how: "expired".into()
            })
        );
        let leader = pb::ErrorDetail {
            leader_id: Some(u64::MAX),
            leader_addr: "10.0.0.2:7700".into(),
            ..detail(R::NotLeader)
        };
        assert_eq!(
            CallError::from_detail(&leader),
            CallError::NotLeader {
                leader_id: Some(u64::MAX),
                leader_addr: Some("10.0.0.2:7700".into())
            }
        );
        let bad = pb::ErrorDetail {
            field: "want".into(),
            ..detail(R::BadInput)
        };
        assert!(matches!(
            CallError::from_detail(&bad),
            CallError::Rejected { field, .. } if field == "want"
        ));
        // A reason from a newer allocator: refused, never fenced or retried.
        let newer = pb::ErrorDetail {
            reason: i32::MAX,
            ..detail(R::Unspecified)
        };
        assert_eq!(CallError::from_detail(&newer), rejected(R::Unspecified));
    }

    #[test]
    fn a_typed_detail_decides_the_class_not_the_code() {
        let typed = |code, reason| error_detail::status(code, &detail(reason));
        // The typed detail wins over the code (a stale epoch is not a leader hint).
        assert!(matches!(
            CallError::from_status(&typed(Code::FailedPrecondition, R::StaleEpoch)),
            CallError::Fenced {
                why: Fence::StaleEpoch,
                ..
            }
        ));
        assert!(matches!(
            CallError::from_status(&typed(Code::FailedPrecondition, R::NotHolder)),
            CallError::Fenced {
                why: Fence::NotHolder,
                ..
            }
        ));
        assert!(matches!(
            CallError::from_status(&typed(Code::ResourceExhausted, R::KeyCapReached)),
            CallError::Rejected {
                reason: R::KeyCapReached,
                ..
            }
        ));
        assert!(matches!(
            CallError::from_status(&typed(Code::ResourceExhausted, R::Overloaded)),
            CallError::Overloaded { .. }
        ));
        let no_leader = CallError::from_status(&typed(Code::Unavailable, R::NotLeader));
        assert_eq!(
            no_leader,
            CallError::NotLeader {
                leader_id: None,
                leader_addr: None
            }
        );
        assert!(no_leader.is_transient());
    }

    #[test]
    fn without_a_detail_the_code_decides() {
        assert_eq!(
            CallError::from_status(&Status::unimplemented("old")),
            CallError::Unsupported
        );
        // An allocator before typed details: an empty FAILED_PRECONDITION is a fenced
        // allocation, a bare LeaderHint in its details is where the leader is.
        assert!(matches!(
            CallError::from_status(&Status::failed_precondition("stale")),
            CallError::Fenced {
                why: Fence::Unspecified,
                ..
            }
        ));
        let hint = pb::LeaderHint {
            leader_id: Some(2),
            leader_addr: "a:1".into(),
        };
        let legacy = Status::with_details(
            Code::FailedPrecondition,
            "not the leader",
            hint.encode_to_vec().into(),
        );
        assert_eq!(
            CallError::from_status(&legacy),
            CallError::NotLeader {
                leader_id: Some(2),
                leader_addr: Some("a:1".into())
            }
        );
        for s in [
            Status::unavailable("down"),
            Status::deadline_exceeded("slow"),
            Status::cancelled("gone"),
            Status::internal("h2"),
        ] {
            let e = CallError::from_status(&s);
            assert!(matches!(e, CallError::Unreachable { .. }), "{s:?}");
            assert!(e.is_transient());
        }
        let e = CallError::from_status(&Status::invalid_argument("bad"));
        assert!(matches!(e, CallError::Rejected { .. }) && !e.is_transient());
    }
}
