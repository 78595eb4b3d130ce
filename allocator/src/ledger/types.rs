//! Commands, responses and errors of the lease ledger: what crosses the Raft log.

use super::LedgerError;
use serde::{Deserialize, Serialize};

/// The key a global quota is kept under: a domain and a request descriptor's entries.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PolicyKey {
    /// Config domain.
    pub domain: String,
    /// Descriptor entries (key, value), outermost first.
    pub entries: Vec<(String, String)>,
}

/// A region's share as an operator states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Share {
    /// Parts per million of the policy's rate and capacity.
    Ppm(u32),
    /// Absolute requests per unit (at most the policy's `requests_per_unit`).
    Rate(u64),
}

/// The limit a [`KeyStatus`] reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusLimit {
    /// `requests_per_unit`.
    pub requests_per_unit: u64,
    /// `unit`, as Envoy spells it (`SECOND`, `MINUTE`, `HOUR`, `DAY`).
    pub unit: String,
    /// `unit_multiplier`.
    pub unit_multiplier: u64,
    /// Capacity (burst, or a window's limit), whole tokens.
    pub capacity_tokens: u64,
}

/// A region and its share, for [`Command::SetShares`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareSpec {
    /// Region name.
    pub region: String,
    /// Its share.
    pub share: Share,
}

/// Ask for a batch of tokens (design §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acquire {
    /// Which global quota.
    pub key: PolicyKey,
    /// Region of the holder.
    pub region: String,
    /// Holder (agent id) inside the region.
    pub holder: String,
    /// Microtokens wanted over one lease period; > 0.
    pub want: u64,
    /// The holder's measured demand, microtokens per second; 0 when it does not know. Weighs
    /// its region's claim in the division among regions (design §5).
    pub demand_per_s: u64,
    /// The refill rate the holder asks to accrue over its lease, microtokens per second; 0 for
    /// a plain grant (design §9).
    pub want_rate_per_s: u64,
    /// Client-chosen id: a retry with the same (holder, id) gets the same answer, charged once.
    pub request_id: String,
}

/// Decide one request centrally (design §2): debit `cost` from every source at once, or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decide {
    /// Which global quota.
    pub key: PolicyKey,
    /// Region of the holder (its part is debited when the policy has regional shares).
    pub region: String,
    /// Holder (agent id) inside the region.
    pub holder: String,
    /// Cost of the request, microtokens; > 0.
    pub cost: u64,
    /// Client-chosen id: a retry with the same (holder, id) gets the same answer, charged once.
    pub request_id: String,
}

/// A state-changing command. Every command is applied at the leader-stamped time of its entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Install a new version of one domain's policy document (YAML).
    PutPolicy {
        /// The document.
        yaml: String,
        /// Version the caller expects to replace (0 for a new domain).
        expected_version: u64,
        /// Client-chosen id (≤ 256 bytes): a retry with the same id and content answers the
        /// first success, applied once (`admin`); empty: no deduplication.
        request_id: String,
    },
    /// Set a policy's regional shares (versioned handoff, design §5).
    SetShares {
        /// Policy (rule) name.
        policy: String,
        /// New shares; regions not listed keep theirs.
        shares: Vec<ShareSpec>,
        /// Must be greater than the policy's current share version.
        config_version: u64,
        /// Client-chosen id, as [`Command::PutPolicy`]'s.
        request_id: String,
    },
    /// Lease tokens.
    Acquire(Acquire),
    /// Report cumulative spend (max-merged, idempotent).
    Report {
        /// Allocation id.
        allocation_id: u64,
        /// Its epoch.
        epoch: u64,
        /// The reporting holder; must be the allocation's.
        holder: String,
        /// Cumulative microtokens spent since the grant.
        cumulative_spend: u64,
    },
    /// Hand an allocation back with its final spend.
    Release {
        /// Allocation id.
        allocation_id: u64,
        /// Its epoch.
        epoch: u64,
        /// The releasing holder; must be the allocation's.
        holder: String,
        /// Final cumulative microtokens spent.
        final_spend: u64,
    },
    /// Advance time only: expire allocations, finish handoffs.
    Tick,
    /// Decide one request centrally, with no allocation.
    Decide(Decide),
    /// Several commands applied in order in one entry at its one stamped time (group commit);
    /// answered by [`Response::Batch`] with one response per command. A batch inside a batch is
    /// refused.
    Batch(Vec<Command>),
    /// A [`Command::Report`] or [`Command::Release`] fenced by the ledger incarnation its
    /// allocation was granted in ([`Grant::incarnation`]): refused with
    /// [`LedgerError::StaleIncarnation`], changing nothing, when the ledger's incarnation is
    /// another (the allocation belongs to a ledger whose state was lost; its id may have been
    /// granted again since). A variant of its own, last, so log entries and snapshots written
    /// before it still decode (bincode numbers variants by position). A plain Report or
    /// Release (an agent that sends no incarnation) is not fenced this way.
    InIncarnation {
        /// The incarnation the allocation was granted in; never 0.
        incarnation: u64,
        /// The Report or Release.
        command: Box<Command>,
    },
}

/// A granted allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Never reused.
    pub allocation_id: u64,
    /// Equal to the allocation id, hence strictly increasing per policy + region + holder.
    pub epoch: u64,
    /// Microtokens granted now (the base); > 0 unless the grant carries a rate.
    pub granted: u64,
    /// Leader-stamped grant time, Unix ms.
    pub issued_at_ms: u64,
    /// Expiry, Unix ms; the holder must stop spending before it.
    pub expires_at_ms: u64,
    /// Policy document version it was granted under.
    pub policy_version: u64,
    /// Refill rate the holder accrues until its local deadline, microtokens per second (0:
    /// none; design §9).
    pub rate_per_s: u64,
    /// The most the rate adds over the lease, microtokens (in the overshoot bound).
    pub promised: u64,
    /// The ledger's incarnation ([`super::Ledger::incarnation`]): the holder sends it back with
    /// every Report and Release. Set on the way out of `apply_at`, not stored: a remembered
    /// answer (kept in snapshots) keeps its pre-incarnation encoding.
    #[serde(skip)]
    pub incarnation: u64,
}

/// Nothing could be granted now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Denial {
    /// When asking again can succeed, ms from now (from the buckets' refill); under a flood,
    /// when the refill holds a token for each of the key's hungry holders in the region
    /// (design §5, "Denials under a flood").
    pub retry_after_ms: u64,
    /// What ran out.
    pub reason: String,
    /// Policy document version that denied.
    pub policy_version: u64,
    /// When asking again may find more because another region's unused part becomes lendable
    /// (see `division::SETTLE_MS`), ms from now, when sooner than `retry_after_ms`; 0 otherwise.
    /// A request still within its wait bound then may ask again instead of being denied.
    /// Computed at apply time and not stored: a remembered answer carries 0.
    #[serde(skip)]
    pub handoff_ms: u64,
}

/// The answer to a [`Decide`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decided {
    /// Whether the cost was admitted (and debited from every source).
    pub allowed: bool,
    /// Microtokens left in the tightest source after the decision.
    pub remaining: u64,
    /// When denied, ms until a retry can succeed (exact refill, rounded up; ≥ 1); 0 when allowed
    /// or when it never can.
    pub retry_after_ms: u64,
    /// Denied because the cost is above a source's capacity: no retry can succeed.
    pub never: bool,
    /// What ran out, for a denial; empty when allowed.
    pub reason: String,
    /// Policy document version that decided.
    pub policy_version: u64,
    /// As [`Denial::handoff_ms`]: for a denial, when another region's unused part may be lent,
    /// ms from now, when sooner than `retry_after_ms`; 0 otherwise. Not stored.
    #[serde(skip)]
    pub handoff_ms: u64,
}

/// The result of applying a command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// A policy version is in force.
    PolicyPut {
        /// Domain of the document.
        domain: String,
        /// Version now in force.
        version: u64,
    },
    /// Shares are set.
    SharesSet {
        /// Share version now in force.
        config_version: u64,
    },
    /// Acquire granted.
    Granted(Grant),
    /// Acquire denied.
    Denied(Denial),
    /// Report recorded.
    Reported {
        /// Recorded cumulative spend after the merge, microtokens.
        recorded: u64,
        /// Expiry, Unix ms.
        expires_at_ms: u64,
    },
    /// Release done.
    Released {
        /// Microtokens returned to the bucket.
        returned: u64,
    },
    /// Tick applied.
    Ticked,
    /// A central decision.
    Decided(Decided),
    /// The responses of a [`Command::Batch`], in its commands' order.
    Batch(Vec<Response>),
    /// The command was refused; nothing changed.
    Rejected(LedgerError),
}

/// Per-region view of one policy key (design §6: the overshoot bound as a number).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionStatus {
    /// Region name.
    pub region: String,
    /// Live (unexpired, unreleased) allocations.
    pub live_allocations: u64,
    /// Σ granted over live allocations, microtokens.
    pub granted: u64,
    /// Σ reported spend over live allocations, microtokens.
    pub reported: u64,
    /// Unreported tokens of allocations that expired (they stay spent), microtokens, cumulative.
    pub stranded: u64,
    /// Σ(granted − reported) over live allocations, microtokens.
    pub overshoot_bound: u64,
    /// The region's part of this key now (what new grants may use), parts per million, when
    /// the policy has regional shares.
    pub share_ppm: Option<u32>,
    /// The region's configured share (guarantee and weight, or cap), ppm, when the policy has
    /// regional shares.
    pub guarantee_ppm: Option<u32>,
    /// What a lowered part still holds back above `share_ppm` until the allocations granted
    /// under the larger part end (a handoff in progress), ppm.
    pub reserved_ppm: u32,
}

/// Status of one policy key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStatus {
    /// Policy (rule) name.
    pub policy: String,
    /// Policy document version.
    pub policy_version: u64,
    /// The rule's rate: `requests_per_unit` per `unit_multiplier` × `unit`, and its capacity
    /// in whole tokens; `None` for an unlimited rule.
    pub limit: Option<StatusLimit>,
    /// Microtokens in the global bucket (or left in the current window) now.
    pub bucket_tokens: u64,
    /// Microtokens left in the calendar quota's current period, when configured.
    pub calendar_remaining: Option<u64>,
    /// Per region, sorted by name.
    pub regions: Vec<RegionStatus>,
}
