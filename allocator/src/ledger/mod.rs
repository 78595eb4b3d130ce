//! The lease ledger (design §3–6, design §10 "Config versions"): a pure, deterministic state
//! machine of policies, global buckets and epoch-fenced, expiring allocations. No openraft types,
//! no clock: every command is applied at the time the Raft leader stamped into its log entry, so
//! every replica computes the same state.
//!
//! Invariants kept here:
//! * live entitlement never exceeds the contract: a grant debits the global bucket (and the
//!   region's bucket and the calendar quota) when it is made, and unspent tokens come back only
//!   when the final spend is known (release), never above capacity;
//! * an expired allocation's unreported tokens stay spent (stranded quota);
//! * allocation ids are never reused within an incarnation of the ledger; an allocation's epoch
//!   is its id, so epochs strictly increase per policy + region + holder without a table that
//!   grows with every holder. A ledger recreated empty after its state was lost counts ids from
//!   1 again, but under another incarnation ([`Ledger::incarnation`]): the pair (incarnation,
//!   id) is never reused;
//! * a report or release with a stale id, epoch or incarnation, or from another holder, is
//!   refused and changes nothing;
//! * ended allocations are kept for a bounded time and number ([`ENDED_RETENTION_MS`],
//!   [`MAX_ENDED_KEPT`]) so a retried release gets its same answer; after that any id up to the
//!   last one granted answers "ended" and a larger one "not found", deterministically;
//! * totals never overflow: a grant is capped so the live totals stay representable;
//! * a release refunds only into what its grant was charged to (same algorithm family, same
//!   calendar period), never into state that was never charged;
//! * a region's lowered part of a key keeps its old reservation until every allocation granted
//!   under an older handoff version is released or expired; only then can another region's
//!   part grow (`handoff`); Σ parts held never exceeds the whole.

mod acquire;
mod admin;
mod calendar;
mod decide;
mod division;
mod error;
mod fair_share;
mod handoff;
mod invariants;
mod names;
mod persistent;
mod policy;
mod rates;
mod settle;
mod small_map;
mod sorted_deque;
mod sources;
mod tables;
mod types;

pub use admin::{ADMIN_RETENTION_MS, MAX_REMEMBERED_ADMIN};
pub use calendar::period_bounds;
pub use error::{Ended, LedgerError, Table};
pub use fair_share::{fair_part, one_token_ppm, region_parts, RegionClaim};
pub use handoff::HYSTERESIS_PPM;
pub use invariants::InvariantError;
pub use names::{KeyBytes, Name};
pub use rates::MAX_RATE_PPM;
pub use sources::MAX_ID_BYTES;
pub use tables::{
    TableCounters, TableKind, TableStats, TableUsage, EVICTION_PROBES, IDLE_KEY_RETENTION_MS,
    MAX_FORGOTTEN_PER_CHECK,
};
pub use types::{
    Acquire, Command, Decide, Decided, Denial, Grant, KeyStatus, PolicyKey, RegionStatus, Response,
    Share, ShareSpec, StatusLimit,
};

use allot_common::algorithm::{AlgorithmKind, LimitParams, LimitState};
use allot_common::config::DomainConfig;
use allot_common::units::{millis_to_nanos, Micros, MICROS_PER_TOKEN};
use imbl::{OrdMap, OrdSet};
use names::Names;
use serde::{Deserialize, Serialize};
use small_map::SmallMap;
use sorted_deque::SortedDeque;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// How long an Acquire or Decide answer is kept for retries with the same request id, in ms.
pub const REQUEST_RETENTION_MS: u64 = 10 * 60 * 1000;
/// Most Acquire and Decide answers kept for retries; the oldest go first.
pub const MAX_REMEMBERED_REQUESTS: usize = 100_000;
/// How long an ended (released or expired) allocation is remembered, in ms: a retried Release
/// within it gets its same answer. Afterwards the allocation is forgotten (item 1 of issue 10).
pub const ENDED_RETENTION_MS: u64 = REQUEST_RETENTION_MS;
/// Most ended allocations remembered; the oldest are forgotten first.
pub const MAX_ENDED_KEPT: usize = 100_000;

/// Stored incarnation of a ledger restored from a snapshot written before incarnations existed
/// (see [`Ledger::restore_incarnation`]): it grants with incarnation 0 and fences nothing by
/// incarnation, as before.
const LEGACY_INCARNATION: u64 = u64::MAX;

/// (rule id, canonical descriptor key).
type KeyId = (Name, KeyBytes);

/// State of allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocationState {
    /// Spendable until `expires_at_ms`.
    Live,
    /// Returned with its final spend.
    Released {
        /// Microtokens returned to the bucket.
        returned: u64,
    },
    /// Passed `expires_at_ms + max_drift`; unreported tokens are stranded.
    Expired,
}

/// One allocation: a batch of spendable tokens held by one agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Never reused.
    pub id: u64,
    /// Rule id of the policy.
    pub rule_id: Name,
    /// Canonical key of the policy key.
    pub key: KeyBytes,
    /// Policy document version at grant.
    pub policy_version: u64,
    /// Handoff version of its key's regional parts at grant (see `handoff`).
    pub shares_version: u64,
    /// Region.
    pub region: Name,
    /// Holder.
    pub holder: Name,
    /// Epoch.
    pub epoch: u64,
    /// Microtokens the holder may spend at most: `base` plus the rate's promise (design §9),
    /// never below `reported`.
    pub granted: Micros,
    /// Microtokens granted at once (debited from the buckets at grant).
    pub base: Micros,
    /// Rate carried while it accrues, parts per million of the policy's rate (0: none, or its
    /// accrual ended early by a superseding Acquire).
    pub rate_ppm: u32,
    /// The rate the holder accrues, microtokens per second (0: none).
    pub rate_per_s: u64,
    /// When the accrual ends, Unix ms: `expires_at_ms`, or the time of a superseding Acquire.
    pub accrual_end_ms: u64,
    /// Highest cumulative spend reported, clamped to `granted`.
    pub reported: Micros,
    /// Grant time, Unix ms.
    pub issued_at_ms: u64,
    /// Expiry, Unix ms.
    pub expires_at_ms: u64,
    /// When it is dead even for a drifting agent: expires_at + max drift, Unix ms.
    pub dead_at_ms: u64,
    /// Current state.
    pub state: AllocationState,
    /// What the grant was charged to; a release refunds only there.
    pub charged: ChargedTo,
}

/// What a grant was debited from and counted in, recorded at grant time so that a release
/// refunds only into state that was charged (issue 10 item 13): not into a bucket whose
/// algorithm family changed since, nor into a calendar quota added or rolled over since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargedTo {
    /// Algorithm of the global bucket debited.
    pub global: AlgorithmKind,
    /// Algorithm of the region's bucket debited, when the region had one.
    pub region: Option<AlgorithmKind>,
    /// Start (Unix ms) of the calendar period debited, when the policy had a quota.
    pub calendar_period_start: Option<u64>,
}

/// A bucket with the parameters its state was last computed under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Bucket {
    params: LimitParams,
    state: LimitState,
}

/// Per policy key and region: the region's bucket and its allocation totals.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct RegionKeyState {
    /// `None` when the policy has no regional shares (boxed: most policies have none).
    bucket: Option<Box<Bucket>>,
    live: u64,
    granted_live: Micros,
    reported_live: Micros,
    stranded: Micros,
    /// Σ `rate_ppm` over its live allocations that still accrue (design §9).
    rate_ppm_live: u64,
    /// (holder, id) of those allocations.
    rated: BTreeSet<(Name, u64)>,
}

/// State of one policy key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct KeyState {
    global: Bucket,
    regions: SmallMap<Name, RegionKeyState>,
    /// (period start ms, microtokens used) of the calendar quota.
    calendar: Option<(u64, Micros)>,
    live: u64,
    /// Regional parts and their handoff; empty when the policy has no regional shares.
    parts: handoff::Parts,
    /// When the key's state was created, Unix ms.
    created_ms: u64,
    /// When the key becomes evictable if nothing touches it (`tables::idle_at`), Unix ms;
    /// `None` while it has a live allocation. Kept in snapshots: the idle index is rebuilt
    /// from it, so every replica evicts the same key.
    idle_at_ms: Option<u64>,
    /// The policy's parameters the global bucket was last tuned to, before the live rates'
    /// part of its refill is diverted to their holders (design §9).
    undiverted: LimitParams,
}

impl KeyState {
    /// A key first seen at `now` (Unix ms): a full global bucket of `params`, no regions, no
    /// calendar use, idle until something is granted.
    fn new(params: LimitParams, now: u64) -> Self {
        KeyState {
            global: Bucket {
                params,
                state: params.initial_state(millis_to_nanos(now)),
            },
            regions: Default::default(),
            calendar: None,
            live: 0,
            parts: Default::default(),
            created_ms: now,
            idle_at_ms: Some(now),
            undiverted: params,
        }
    }
}

/// A policy document in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct PolicyDoc {
    yaml: String,
    version: u64,
    activated_at_ms: u64,
}

/// A region's share of one policy as configured or set by an operator: a hard cap with
/// `shares_mode: cap`, else the region's guaranteed minimum and its weight. Each key's parts
/// move toward it by handoff (`handoff`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct RegionShareState {
    /// What the operator asked for, ppm.
    target_ppm: u32,
}

/// Regional shares of one policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct PolicyShares {
    config_version: u64,
    regions: BTreeMap<String, RegionShareState>,
}

/// Violation counters: spend reported beyond a grant (clamped, never credited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violations {
    /// Reports or releases that claimed more than the grant.
    pub count: u64,
    /// Σ claimed − granted over them, microtokens.
    pub excess: Micros,
}

/// The ledger. See the module docs for its invariants.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ledger {
    last_ms: u64,
    docs: BTreeMap<String, PolicyDoc>,
    #[serde(skip)]
    parsed: BTreeMap<String, DomainConfig>,
    shares: BTreeMap<String, PolicyShares>,
    /// The tables that grow with keys, allocations and requests are imbl's persistent B-trees
    /// (`OrdMap`, `OrdSet`): cloning one is O(1) (its root shared), and a node is copied only
    /// when written while shared. A snapshot's copy ([`Ledger::snapshot_copy`]) then copies
    /// only the capped index `ended` and the admin answers (the answers' time index is
    /// rebuilt by its encoding), where a deep copy held the state machine, and with it every
    /// apply, for ~1.5 µs per key (150 ms at 100,000 keys; `tests_memory`) on every node at
    /// every snapshot. Same
    /// serde form as the std collections they replaced (a map, a sequence), so snapshots
    /// decode alike (`tests_encoding`), and decoded through them (`persistent`).
    ///
    /// Boxed, as are the allocations: a B-tree node holds sixteen slots and is often half
    /// full, so an inline value would cost its size about twice. While a snapshot's copy
    /// shares a node, the first write to it copies its boxed values too.
    #[serde(deserialize_with = "persistent::map")]
    keys: OrdMap<KeyId, Box<KeyState>>,
    /// Live allocations and ended ones not yet forgotten.
    #[serde(deserialize_with = "persistent::map")]
    allocations: OrdMap<u64, Box<Allocation>>,
    /// Live allocations by (dead_at_ms, id).
    #[serde(deserialize_with = "persistent::set")]
    deadlines: OrdSet<(u64, u64)>,
    /// Ended allocations by (ended at ms, id), oldest first (ledger time never goes back).
    /// A ring buffer, copied with a snapshot: at most [`MAX_ENDED_KEPT`] entries of 16 B.
    ended: VecDeque<(u64, u64)>,
    next_id: u64,
    /// Recent asks per (key, region): holder → ask, for fair division.
    #[serde(deserialize_with = "persistent::map")]
    demands: OrdMap<(KeyId, Name), SmallMap<Name, division::Ask>>,
    /// (holder, request id) → (time, answer). Boxed: the request ids of one holder often
    /// grow with time, so the B-tree's nodes stay about half full.
    #[serde(deserialize_with = "persistent::map")]
    requests: OrdMap<(Name, Name), Box<(u64, Response)>>,
    /// (time, holder, request id) of `requests`, oldest first; the same two names, shared.
    /// A ring buffer (40 B an entry where a B-tree took about 100) of at most
    /// [`MAX_REMEMBERED_REQUESTS`] entries, which a snapshot's copy leaves out and its
    /// encoding rebuilds from `requests` ([`Ledger::completed`]). imbl's `Vector` in its place copied
    /// chunks on insertion (a sixth of the allocator's CPU under overload in a profile).
    request_times: SortedDeque<(u64, Name, Name)>,
    /// Admin write answers by client request id (`admin`).
    admin: admin::AdminRequests,
    violations: Violations,
    /// Indexes derived from `keys` and `demands` (`tables`); rebuilt on restore.
    #[serde(skip)]
    index: tables::KeyIndex,
    /// Refusal and eviction counters per capped table: node-local metrics, not replicated.
    #[serde(skip)]
    stats: tables::TableStats,
    /// Rule ids, regions and holders in use, shared by the tables that name them (`names`);
    /// memory layout only, not replicated.
    #[serde(skip)]
    names: Names,
    /// Which life of the ledger this is: the stamp (Unix ms) of the first command it applied,
    /// 0 before that, [`LEGACY_INCARNATION`] when restored from a snapshot without one. Every
    /// replica applies the same first entry, so all agree. Not serialised with the rest:
    /// snapshots carry it after the ledger's bytes (`raft::ledger_app`), so snapshots written
    /// before it still decode.
    #[serde(skip)]
    incarnation: u64,
}

impl Ledger {
    /// Applies `cmd` at the leader-stamped `now_ms` (clamped so time never goes back).
    pub fn apply_at(&mut self, cmd: &Command, now_ms: u64) -> Response {
        let prev_ms = self.last_ms;
        let now = now_ms.max(prev_ms);
        self.last_ms = now;
        if self.incarnation == 0 {
            self.incarnation = now.clamp(1, LEGACY_INCARNATION - 1);
        }
        self.expire(now);
        self.forget_requests(now);
        self.forget_admin(now);
        self.forget_idle_keys(prev_ms, now);
        let r = match cmd {
            Command::PutPolicy {
                yaml,
                expected_version,
                request_id,
            } => self.admin_write(cmd, request_id, now, |l| {
                l.put_policy(yaml, *expected_version, now)
            }),
            Command::SetShares {
                policy,
                shares,
                config_version,
                request_id,
            } => self.admin_write(cmd, request_id, now, |l| {
                l.set_shares(policy, shares, *config_version, now)
            }),
            Command::Acquire(a) => self.acquire(a, now),
            Command::Report {
                allocation_id,
                epoch,
                holder,
                cumulative_spend,
            } => self.report(*allocation_id, *epoch, holder, *cumulative_spend),
            Command::Release {
                allocation_id,
                epoch,
                holder,
                final_spend,
            } => self.release(*allocation_id, *epoch, holder, *final_spend, now),
            Command::Tick => Response::Ticked,
            Command::Decide(d) => self.decide(d, now),
            Command::InIncarnation {
                incarnation,
                command,
            } => self.in_incarnation(*incarnation, command, now),
            Command::Batch(items) => Response::Batch(
                items
                    .iter()
                    .map(|c| match c {
                        Command::Batch(_) => Response::Rejected(LedgerError::BadInput {
                            field: "batch".into(),
                            reason: "a batch cannot contain a batch".into(),
                        }),
                        c => self.apply_at(c, now),
                    })
                    .collect(),
            ),
        };
        self.forget_ended(now);
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_invariants() {
            panic!("after {cmd:?} at {now}: {e}");
        }
        let mut r = r;
        if let Response::Granted(g) = &mut r {
            // Also for an answer recalled from before a snapshot, which does not store it.
            g.incarnation = self.incarnation();
        }
        r
    }

    /// Applies a Report or Release fenced by the `incarnation` its allocation was granted in:
    /// refused, changing nothing, when this ledger is another incarnation. An incarnation of 0
    /// (not sent) and a legacy ledger (incarnation unknown) fence nothing by incarnation.
    fn in_incarnation(&mut self, incarnation: u64, cmd: &Command, now: u64) -> Response {
        let id = match cmd {
            Command::Report { allocation_id, .. } | Command::Release { allocation_id, .. } => {
                *allocation_id
            }
            _ => {
                return Response::Rejected(LedgerError::BadInput {
                    field: "incarnation".into(),
                    reason: "only a report or a release carries an incarnation".into(),
                })
            }
        };
        let have = self.incarnation();
        if incarnation != 0 && have != 0 && incarnation != have {
            return Response::Rejected(LedgerError::StaleIncarnation {
                id,
                have,
                got: incarnation,
            });
        }
        self.apply_at(cmd, now)
    }

    /// Which life of the ledger this is (design §3): the leader-stamped time, Unix ms, of the
    /// first command it applied. A ledger recreated empty after its state was lost grants ids
    /// from 1 again under a new incarnation, and refuses a report or release of the old one.
    /// 0 before the first command, and for a ledger restored from a snapshot written before
    /// incarnations existed (it fences nothing by incarnation, as before).
    pub fn incarnation(&self) -> u64 {
        if self.incarnation == LEGACY_INCARNATION {
            0
        } else {
            self.incarnation
        }
    }

    /// The incarnation as a snapshot stores it (after the ledger's bytes).
    pub fn stored_incarnation(&self) -> u64 {
        self.incarnation
    }

    /// A copy for a Raft snapshot, independent of the number of keys: the tables that grow
    /// with keys share their nodes with this ledger's (copy-on-write, see the fields); the
    /// capped index `ended` (16 B an entry) and the admin answers are copied; the time index of
    /// remembered answers is left out, rebuilt by [`Ledger::completed`] off the lock (copying
    /// its 100,000 entries, two shared names each, took 5–26 ms in the cluster bench while
    /// every apply waited); the node-local tables (parsed policies, indexes, statistics,
    /// interned names) are left empty, since the snapshot does not carry them. Only for
    /// encoding ([`Ledger::snapshot`]-equal bytes, tested): commands applied to it would find
    /// no policy.
    pub(crate) fn snapshot_copy(&self) -> Ledger {
        Ledger {
            last_ms: self.last_ms,
            docs: self.docs.clone(),
            parsed: BTreeMap::new(),
            shares: self.shares.clone(),
            keys: self.keys.clone(),
            allocations: self.allocations.clone(),
            deadlines: self.deadlines.clone(),
            ended: self.ended.clone(),
            next_id: self.next_id,
            demands: self.demands.clone(),
            requests: self.requests.clone(),
            request_times: SortedDeque::default(),
            admin: self.admin.clone(),
            violations: self.violations,
            index: tables::KeyIndex::default(),
            stats: tables::TableStats::default(),
            names: Names::default(),
            incarnation: self.incarnation,
        }
    }

    /// Whether every serialised table is here: false only for a [`Ledger::snapshot_copy`] of a
    /// ledger remembering answers, until [`Ledger::completed`].
    pub(crate) fn is_complete(&self) -> bool {
        self.request_times.len() == self.requests.len()
    }

    /// This ledger with what [`Ledger::snapshot_copy`] left out rebuilt: the time index of
    /// remembered answers, which is exactly their (time, holder, request id) in order
    /// ([`Ledger::check_answer_index`]). O(n log n) in the answers; a complete ledger is
    /// returned as it is.
    pub(crate) fn completed(mut self) -> Ledger {
        if !self.is_complete() {
            self.request_times = self
                .requests
                .iter()
                .map(|((holder, id), answer)| (answer.0, holder.clone(), id.clone()))
                .collect();
        }
        self
    }

    /// This ledger as a snapshot serialises it: itself when complete, else a completed clone
    /// ([`Ledger::completed`]; a snapshot's copy, whose clone is cheap).
    pub(crate) fn whole(&self) -> std::borrow::Cow<'_, Ledger> {
        if self.is_complete() {
            std::borrow::Cow::Borrowed(self)
        } else {
            std::borrow::Cow::Owned(self.clone().completed())
        }
    }

    /// Sets the incarnation a snapshot stored, `None` for a snapshot written before
    /// incarnations existed: a ledger that applied nothing then takes one at its first command
    /// as usual; any other is marked legacy for good. It cannot take one now: a replica
    /// replaying the log from its start instead of this snapshot would take another, and the
    /// replicas would then fence differently.
    pub fn restore_incarnation(&mut self, stored: Option<u64>) {
        self.incarnation = match stored {
            Some(i) => i,
            None if self.last_ms == 0 => 0,
            None => LEGACY_INCARNATION,
        };
    }

    /// The latest applied time, Unix ms.
    pub fn last_ms(&self) -> u64 {
        self.last_ms
    }

    /// Version of a domain's policy document (0 when absent).
    pub fn policy_version(&self, domain: &str) -> u64 {
        self.docs.get(domain).map_or(0, |d| d.version)
    }

    /// The policy document (YAML) in force for a domain, if any. Lets an installer skip a
    /// document that is already in force instead of bumping its version again.
    pub fn policy_yaml(&self, domain: &str) -> Option<&str> {
        self.docs.get(domain).map(|d| d.yaml.as_str())
    }

    /// The smallest `lease.max_drift_ms` of the rules in force, ms: the tightest clock margin
    /// the ledger allows; `None` without policies. Nodes warn when their clock is further off
    /// ledger time than this (issue 10 item 2).
    pub fn min_max_drift_ms(&self) -> Option<u64> {
        self.parsed
            .values()
            .flat_map(|d| d.rules.iter())
            .map(|r| r.lease.max_drift_ms)
            .min()
    }

    /// An allocation by id.
    pub fn allocation(&self, id: u64) -> Option<&Allocation> {
        self.allocations.get(&id).map(|a| &**a)
    }

    /// Every allocation, by id.
    pub fn allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocations.values().map(|a| &**a)
    }

    /// Spend claimed beyond grants so far.
    pub fn violations(&self) -> Violations {
        self.violations
    }

    /// Number of policy keys held.
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Status of one policy key as of `now_ms` (read-only: nothing is expired or refilled).
    ///
    /// # Errors
    /// [`LedgerError::UnknownDomain`], [`LedgerError::NoMatchingLimit`] or
    /// [`LedgerError::NoKeyState`] for a key with nothing to show; [`LedgerError::BadInput`] for a
    /// malformed key.
    pub fn status(&self, key: &PolicyKey, now_ms: u64) -> Result<KeyStatus, LedgerError> {
        let (rule, kid, doc_version) = self.resolve(key)?;
        let ks = self.keys.get(&kid).ok_or_else(|| LedgerError::NoKeyState {
            policy: rule.name.clone(),
        })?;
        let now_ns = millis_to_nanos(now_ms.max(self.last_ms));
        let mut g = ks.global.state.clone();
        let bucket_tokens = ks.global.params.check(&mut g, now_ns, 0).remaining_micros;
        let calendar_remaining = rule.quota.map(|q| {
            let (start, _) = period_bounds(q.period, now_ms.max(self.last_ms));
            let used = match ks.calendar {
                Some((s, u)) if s == start => u,
                _ => 0,
            };
            q.limit.saturating_sub(used)
        });
        let guarantees = self.shares.get(&rule.id);
        let regions = ks
            .regions
            .iter()
            .map(|(name, r)| RegionStatus {
                region: name.to_string(),
                live_allocations: r.live,
                granted: r.granted_live,
                reported: r.reported_live,
                stranded: r.stranded,
                overshoot_bound: r.granted_live.saturating_sub(r.reported_live),
                share_ppm: ks
                    .parts
                    .by_region
                    .get(name.as_str())
                    .map(|p| p.effective_ppm),
                guarantee_ppm: guarantees
                    .and_then(|g| g.regions.get(name.as_str()))
                    .map(|g| g.target_ppm),
                reserved_ppm: ks
                    .parts
                    .by_region
                    .get(name.as_str())
                    .map_or(0, |p| p.reserved_ppm.saturating_sub(p.effective_ppm)),
            })
            .collect();
        let limit = match rule.limit {
            // The rule's own parameters: the key's bucket takes a changed policy's only at its
            // next Acquire or Decide.
            allot_common::config::RuleLimit::Limited {
                requests_per_unit,
                unit,
                unit_multiplier,
                params,
                ..
            } => Some(StatusLimit {
                requests_per_unit,
                unit: unit.envoy_name().to_string(),
                unit_multiplier,
                capacity_tokens: params.capacity() / MICROS_PER_TOKEN,
            }),
            allot_common::config::RuleLimit::Unlimited => None,
        };
        Ok(KeyStatus {
            policy: rule.name.clone(),
            policy_version: doc_version,
            limit,
            bucket_tokens,
            calendar_remaining,
            regions,
        })
    }

    /// Σ(granted − reported) over every live allocation: the ledger-wide overshoot bound, µtokens.
    pub fn overshoot_bound(&self) -> Micros {
        self.keys
            .values()
            .flat_map(|k| k.regions.values())
            .map(|r| r.granted_live.saturating_sub(r.reported_live))
            .fold(0, u64::saturating_add)
    }

    /// Number of allocation records held (live and ended but not yet forgotten).
    pub fn allocation_count(&self) -> usize {
        self.allocations.len()
    }

    /// Rebuilds the state derived from the stored state and not serialised (the parsed policy
    /// documents, the key index of `tables`, the names shared between tables), after a ledger
    /// was decoded from a snapshot.
    ///
    /// # Errors
    /// [`LedgerError::BadInput`] (field `yaml`) naming the domain whose stored document no
    /// longer validates; the ledger must then not be used.
    pub fn rebuild_derived(&mut self) -> Result<(), LedgerError> {
        self.parsed.clear();
        for (domain, doc) in &self.docs {
            let d = policy::parse(&doc.yaml).map_err(|e| LedgerError::BadInput {
                field: "yaml".into(),
                reason: format!("stored policy of domain {domain:?}: {e}"),
            })?;
            self.parsed.insert(domain.clone(), d);
        }
        self.share_names();
        let asks = self.demands.values().map(|m| m.len() as u64).sum();
        self.index = tables::KeyIndex::of(&self.keys, asks);
        Ok(())
    }

    /// The earliest `dead_at` of a live allocation, Unix ms (ledger time); `None` when none is
    /// live. A tick before it expires nothing (the leader's ticker, `daemon::ticker`).
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.deadlines.get_min().map(|&(dead_at, _)| dead_at)
    }

    /// Expires every allocation dead at `now`: its unreported tokens stay spent (stranded).
    fn expire(&mut self, now: u64) {
        while let Some(&(dead_at, id)) = self.deadlines.get_min() {
            if dead_at > now {
                break;
            }
            self.deadlines.remove_min();
            let Some(a) = self.allocations.get_mut(&id) else {
                continue;
            };
            if a.state != AllocationState::Live {
                continue;
            }
            a.state = AllocationState::Expired;
            let a = a.clone();
            self.finish(&a, a.granted.saturating_sub(a.reported), now);
        }
    }

    /// Bookkeeping when a live allocation ends at `now`: its `stranded` unreported tokens are
    /// counted, it leaves the live totals (the region's part may complete a handoff) and is queued
    /// to be forgotten.
    fn finish(&mut self, a: &Allocation, stranded: Micros, now: u64) {
        let kid = (a.rule_id.clone(), a.key.clone());
        if let Some(ks) = self.keys.get_mut(&kid) {
            ks.live = ks.live.saturating_sub(1);
            if let Some(r) = ks.regions.get_mut(&a.region) {
                r.live = r.live.saturating_sub(1);
                r.granted_live = r.granted_live.saturating_sub(a.granted);
                r.reported_live = r.reported_live.saturating_sub(a.reported);
                r.stranded = r.stranded.saturating_add(stranded);
                if r.rated.remove(&(a.holder.clone(), a.id)) {
                    r.rate_ppm_live = r.rate_ppm_live.saturating_sub(u64::from(a.rate_ppm));
                }
            }
            ks.parts.ended(&a.region, a.shares_version);
        }
        self.rebalance_key(&kid, now);
        self.reindex_key(&kid, now);
        // Its rate (if it still accrued) goes back to the buckets' refill from now.
        self.retune_rates(&kid, &a.region, now);
        self.ended.push_back((now, a.id));
    }

    /// Forgets ended allocations older than [`ENDED_RETENTION_MS`], and the oldest beyond
    /// [`MAX_ENDED_KEPT`]. O(1) amortised: each allocation is queued once and dropped once.
    fn forget_ended(&mut self, now: u64) {
        while let Some(&(at, id)) = self.ended.front() {
            let too_many = self.ended.len() > MAX_ENDED_KEPT;
            if !too_many && at.saturating_add(ENDED_RETENTION_MS) > now {
                break;
            }
            self.ended.pop_front();
            self.allocations.remove(&id);
        }
    }

    fn forget_requests(&mut self, now: u64) {
        while let Some((at, h, id)) = self.request_times.first().cloned() {
            let too_many = self.request_times.len() > MAX_REMEMBERED_REQUESTS;
            let retained = at.saturating_add(REQUEST_RETENTION_MS) > now;
            if !too_many && retained {
                break;
            }
            if retained {
                self.stats.evicted(TableKind::Requests);
            }
            self.request_times.pop_first();
            self.requests.remove(&(h, id));
        }
    }

    /// The answer remembered for (`holder`, `request_id`), if any. An answer of another kind
    /// (`is_kind` false: the id was used by another kind of request) is refused, so a retry never
    /// gets an answer its caller cannot read; `kind` names the asking request for the message.
    fn recall(
        &self,
        holder: &str,
        request_id: &str,
        kind: &str,
        is_kind: fn(&Response) -> bool,
    ) -> Option<Response> {
        let (_, r) = &**self
            .requests
            .get(&(Name::from(holder), Name::from(request_id)))?;
        if is_kind(r) {
            return Some(r.clone());
        }
        Some(Response::Rejected(LedgerError::RequestIdReused {
            holder: holder.to_string(),
            request_id: request_id.to_string(),
            kind: kind.to_string(),
        }))
    }

    fn remember(&mut self, holder: &str, request_id: &str, now: u64, r: &Response) {
        let (h, id) = (self.names.intern(holder), Name::from(request_id));
        self.requests
            .insert((h.clone(), id.clone()), Box::new((now, r.clone())));
        self.request_times.insert((now, h, id));
    }
}

#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod tests_admin;
#[cfg(test)]
mod tests_decide;
#[cfg(test)]
mod tests_encoding;
#[cfg(test)]
mod tests_memory;
#[cfg(test)]
mod tests_rates;
#[cfg(test)]
mod tests_tables;
