//! Idempotent admin writes (issue 10 item 15): PutPolicy and SetShares carry a client request
//! id and are deduplicated by it exactly as Acquire is by (holder, request id). A write that
//! committed but whose answer was lost (a forwarded write after a step-down, a broken
//! connection) is retried with the same id and answers its first success, applied once, instead
//! of failing its version precondition. The same id with other content is refused precisely;
//! an empty id keeps the old behaviour (no deduplication).
//!
//! Only successes are remembered (a refusal changed nothing, so a retry is judged afresh), for
//! [`ADMIN_RETENTION_MS`] and at most [`MAX_REMEMBERED_ADMIN`] of them, the oldest forgotten
//! first (counted as evictions of [`TableKind::AdminRequests`] when before their retention ended).

use super::sources::check_id;
use super::tables::TableKind;
use super::{Command, Ledger, LedgerError, Response, Share};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// How long an admin write's answer is kept for retries with the same request id, ms.
pub const ADMIN_RETENTION_MS: u64 = super::REQUEST_RETENTION_MS;
/// Most admin write answers kept; the oldest are forgotten first.
pub const MAX_REMEMBERED_ADMIN: usize = 10_000;

/// What a write contained, to tell its retry from another write reusing its id: a 64-bit
/// FNV-1a digest over the command's fields (length-prefixed, so no two contents run together)
/// and the number of bytes digested. Stable across builds and replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Fingerprint {
    digest: u64,
    len: u64,
}

impl Fingerprint {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Self {
        Fingerprint {
            digest: Self::OFFSET,
            len: 0,
        }
    }

    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.digest = (self.digest ^ u64::from(x)).wrapping_mul(Self::PRIME);
        }
        self.len = self.len.saturating_add(b.len() as u64);
    }

    fn number(&mut self, n: u64) {
        self.bytes(&n.to_le_bytes());
    }

    fn text(&mut self, s: &str) {
        self.number(s.len() as u64);
        self.bytes(s.as_bytes());
    }

    /// The fingerprint of an admin write's content (its request id excluded); `None` for a
    /// command that is not an admin write.
    fn of(cmd: &Command) -> Option<Fingerprint> {
        let mut f = Fingerprint::new();
        match cmd {
            Command::PutPolicy {
                yaml,
                expected_version,
                ..
            } => {
                f.bytes(b"put_policy");
                f.text(yaml);
                f.number(*expected_version);
            }
            Command::SetShares {
                policy,
                shares,
                config_version,
                ..
            } => {
                f.bytes(b"set_shares");
                f.text(policy);
                f.number(shares.len() as u64);
                for s in shares {
                    f.text(&s.region);
                    match s.share {
                        Share::Ppm(p) => {
                            f.bytes(&[0]);
                            f.number(u64::from(p));
                        }
                        Share::Rate(r) => {
                            f.bytes(&[1]);
                            f.number(r);
                        }
                    }
                }
                f.number(*config_version);
            }
            _ => return None,
        }
        Some(f)
    }
}

/// One remembered admin answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct AdminAnswer {
    content: Fingerprint,
    response: Response,
}

/// Remembered admin write answers by request id, with their times in order (ledger time never
/// goes back, so the queue is sorted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct AdminRequests {
    by_id: BTreeMap<String, AdminAnswer>,
    by_time: VecDeque<(u64, String)>,
}

impl AdminRequests {
    /// Answers remembered.
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the id map and the time queue hold the same ids, each once.
    pub(super) fn consistent(&self) -> bool {
        self.by_time.len() == self.by_id.len()
            && self
                .by_time
                .iter()
                .all(|(_, id)| self.by_id.contains_key(id))
    }
}

impl Ledger {
    /// Applies the admin write `cmd` carrying `request_id` through `apply`, deduplicated by the
    /// id (module docs).
    pub(super) fn admin_write(
        &mut self,
        cmd: &Command,
        request_id: &str,
        now: u64,
        apply: impl FnOnce(&mut Ledger) -> Response,
    ) -> Response {
        if request_id.is_empty() {
            return apply(self);
        }
        if let Err(e) = check_id("request_id", request_id) {
            return Response::Rejected(e);
        }
        let Some(content) = Fingerprint::of(cmd) else {
            return apply(self);
        };
        if let Some(a) = self.admin.by_id.get(request_id) {
            if a.content == content {
                return a.response.clone();
            }
            return Response::Rejected(LedgerError::AdminRequestIdReused {
                request_id: request_id.to_string(),
            });
        }
        let r = apply(self);
        if matches!(r, Response::PolicyPut { .. } | Response::SharesSet { .. }) {
            let answer = AdminAnswer {
                content,
                response: r.clone(),
            };
            self.admin.by_id.insert(request_id.to_string(), answer);
            self.admin.by_time.push_back((now, request_id.to_string()));
        }
        r
    }

    /// Forgets admin answers older than [`ADMIN_RETENTION_MS`], and the oldest beyond
    /// [`MAX_REMEMBERED_ADMIN`]. O(1) amortised.
    pub(super) fn forget_admin(&mut self, now: u64) {
        while let Some((at, _)) = self.admin.by_time.front() {
            let too_many = self.admin.by_time.len() > MAX_REMEMBERED_ADMIN;
            let retained = at.saturating_add(ADMIN_RETENTION_MS) > now;
            if !too_many && retained {
                break;
            }
            if retained {
                self.stats.evicted(TableKind::AdminRequests);
            }
            if let Some((_, id)) = self.admin.by_time.pop_front() {
                self.admin.by_id.remove(&id);
            }
        }
    }
}
