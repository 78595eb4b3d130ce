//! Why the ledger refused a command (issue 11 item 4): one domain variant per cause, each with
//! the structured facts a caller acts on. Nothing here is shaped by the transport; the service
//! maps each variant to a gRPC status and a machine-readable detail in one function
//! (`service::errors`).
//!
//! Every refusal leaves the ledger unchanged.

use serde::{Deserialize, Serialize};

/// Why a command was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum LedgerError {
    /// A field of the command is malformed or out of range.
    #[error("bad {field}: {reason}")]
    BadInput {
        /// The offending field, as named in the API (`want`, `holder`, `key`, `yaml`, …).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No policy document is installed for the key's domain.
    #[error("no policy for domain {domain:?}")]
    UnknownDomain {
        /// The domain asked for.
        domain: String,
    },
    /// The domain has a policy but none of its limits matches the key's descriptor.
    #[error("no limit of domain {domain:?} matches this descriptor")]
    NoMatchingLimit {
        /// The key's domain.
        domain: String,
    },
    /// No limit has this name (or id).
    #[error("no policy named {policy:?}")]
    UnknownPolicy {
        /// The name asked for.
        policy: String,
    },
    /// The policy has regional shares and this region is not among them.
    #[error("region {region:?} has no share of policy {policy}")]
    UnknownRegion {
        /// Policy (limit) name.
        policy: String,
        /// The region asked for.
        region: String,
    },
    /// The policy key has never acquired, so it has no state to show.
    #[error("policy key of {policy} has no state yet")]
    NoKeyState {
        /// Policy (limit) name.
        policy: String,
    },
    /// No allocation with this id was ever granted.
    #[error("no allocation {id}")]
    UnknownAllocation {
        /// The id asked for.
        id: u64,
    },
    /// The allocation exists with another epoch: the caller's view is stale (design §4).
    #[error("allocation {id} has epoch {have}, not {got}: stale")]
    StaleEpoch {
        /// Allocation id.
        id: u64,
        /// The allocation's epoch.
        have: u64,
        /// The epoch the caller sent.
        got: u64,
    },
    /// The allocation is held by another holder.
    #[error("allocation {id} is not held by {holder:?}")]
    NotHolder {
        /// Allocation id.
        id: u64,
        /// The holder that asked.
        holder: String,
    },
    /// The allocation was released or expired: it can no longer be reported or released
    /// (other than a retried release with the same final spend).
    #[error("allocation {id} has ended: {how}")]
    AllocationEnded {
        /// Allocation id.
        id: u64,
        /// How it ended.
        how: Ended,
    },
    /// A PutPolicy expected another version of the domain's document.
    #[error("domain {domain:?} is at version {actual}, not {expected}")]
    PolicyVersionMismatch {
        /// Domain of the document.
        domain: String,
        /// The version the caller expected to replace.
        expected: u64,
        /// The version in force.
        actual: u64,
    },
    /// A SetShares carried a share version that is not newer than the one in force.
    #[error("share version {got} of policy {policy} is not greater than the current {current}")]
    SharesVersionNotNewer {
        /// Policy (limit) name.
        policy: String,
        /// Share version in force.
        current: u64,
        /// The version the caller sent.
        got: u64,
    },
    /// The limit has scope local: each agent enforces it alone, nothing is leased or decided
    /// centrally.
    #[error("limit {policy} has scope local: each agent enforces it alone")]
    ScopeLocal {
        /// Policy (limit) name.
        policy: String,
    },
    /// The limit is unlimited: there is no quota to lease, decide or share.
    #[error("limit {policy} is unlimited: there is no quota to lease, decide or share")]
    Unlimited {
        /// Policy (limit) name.
        policy: String,
    },
    /// A limit of the document has a name another domain already uses.
    #[error("limit name {name:?} is already used by another domain")]
    LimitNameTaken {
        /// The clashing name.
        name: String,
    },
    /// A regional share is too small to ever hold one whole token, so its region could never be
    /// granted anything (design §5).
    #[error(
        "share of {region:?} in {policy} is {} of a capacity of {capacity_tokens} tokens, less \
         than one whole token: use at least {} (or 0 for no share), or raise the burst",
        percent(u64::from(*.share_ppm)),
        percent(*.least_ppm)
    )]
    NeverGrantable {
        /// Policy (limit) name.
        policy: String,
        /// The region.
        region: String,
        /// Its share, parts per million.
        share_ppm: u32,
        /// The smallest share that holds one token, parts per million.
        least_ppm: u64,
        /// The limit's capacity, whole tokens.
        capacity_tokens: u64,
    },
    /// The regional shares would add up to more than the whole.
    #[error(
        "region shares of {policy} would add up to {}, more than 100%",
        percent(*.total_ppm)
    )]
    SharesOverfull {
        /// Policy (limit) name.
        policy: String,
        /// Their sum, parts per million.
        total_ppm: u64,
    },
    /// A table keyed by client-chosen values is at its cap and nothing in it can be evicted
    /// (for holders: none of them is older than the idle window; for allocations: none has
    /// ended).
    #[error("{table} is full ({cap} entries), none idle")]
    TableFull {
        /// Which table.
        table: Table,
        /// Its cap, entries.
        cap: u64,
    },
    /// A request id was used before by another kind of request, whose answer this caller could
    /// not read.
    #[error(
        "request_id {request_id:?} of holder {holder:?} was used by another kind of request than {kind}"
    )]
    RequestIdReused {
        /// The holder.
        holder: String,
        /// The reused id.
        request_id: String,
        /// The kind of the asking request (`acquire`, `decide`).
        kind: String,
    },
    /// An admin write's request id was used before by an admin write with other content (a
    /// retry must resend the same write; a new write needs a fresh id).
    #[error(
        "request_id {request_id:?} was used by another admin write with other content; a new \
         write needs a fresh id"
    )]
    AdminRequestIdReused {
        /// The reused id.
        request_id: String,
    },
    /// The allocation was granted by another incarnation of the ledger (one whose state was
    /// lost): the caller's view is stale, whatever the id (design §3). Last, so
    /// snapshots written before it still decode (bincode numbers variants by position).
    #[error(
        "allocation {id} was granted in incarnation {got}, the ledger is incarnation {have}: stale"
    )]
    StaleIncarnation {
        /// Allocation id.
        id: u64,
        /// The ledger's incarnation.
        have: u64,
        /// The incarnation the caller sent.
        got: u64,
    },
}

/// How an allocation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ended {
    /// Handed back with its final spend.
    Released,
    /// Passed its expiry (plus the drift allowance); its unreported tokens stay spent.
    Expired,
    /// Ended long enough ago to be forgotten; whether released or expired is no longer known.
    Forgotten,
}

impl Ended {
    /// The wire name (`ErrorDetail.ended`).
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Released => "released",
            Ended::Expired => "expired",
            Ended::Forgotten => "forgotten",
        }
    }
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ended::Released => "released",
            Ended::Expired => "expired",
            Ended::Forgotten => "released or expired, and forgotten",
        })
    }
}

/// A table of the ledger keyed by client-chosen values, bounded by a cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Table {
    /// The policy keys of one limit (`max_keys`).
    PolicyKeys {
        /// Policy (limit) name.
        policy: String,
    },
    /// The regions of one policy key (`lease.max_regions`).
    Regions {
        /// Policy (limit) name.
        policy: String,
    },
    /// The holders that asked for one policy key in one region within the idle window
    /// (`lease.max_holders`).
    Holders {
        /// Policy (limit) name.
        policy: String,
        /// The region.
        region: String,
    },
    /// The live allocations of one policy key in one region (`lease.max_allocations`).
    Allocations {
        /// Policy (limit) name.
        policy: String,
        /// The region.
        region: String,
    },
}

impl Table {
    /// A short machine-readable name (`ErrorDetail.table`).
    pub fn name(&self) -> &'static str {
        match self {
            Table::PolicyKeys { .. } => "policy_keys",
            Table::Regions { .. } => "regions",
            Table::Holders { .. } => "holders",
            Table::Allocations { .. } => "allocations",
        }
    }
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Table::PolicyKeys { policy } => write!(f, "the key table of limit {policy}"),
            Table::Regions { policy } => write!(f, "the region table of a key of limit {policy}"),
            Table::Holders { policy, region } => write!(
                f,
                "the holder table of a key of limit {policy} in region {region:?}"
            ),
            Table::Allocations { policy, region } => write!(
                f,
                "the live allocations of a key of limit {policy} in region {region:?}"
            ),
        }
    }
}

/// `ppm` as a percentage with four decimals ("2.5000%"), exact.
fn percent(ppm: u64) -> String {
    format!("{}.{:04}%", ppm / 10_000, ppm % 10_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_are_exact_at_the_extremes() {
        assert_eq!(percent(0), "0.0000%");
        assert_eq!(percent(25_000), "2.5000%");
        assert_eq!(percent(1_000_000), "100.0000%");
        assert_eq!(percent(u64::MAX), "1844674407370955.1615%");
    }

    #[test]
    fn messages_carry_their_facts() {
        let e = LedgerError::NeverGrantable {
            policy: "p".into(),
            region: "eu-west".into(),
            share_ppm: 50_000,
            least_ppm: 100_000,
            capacity_tokens: 10,
        };
        let m = e.to_string();
        assert!(m.contains("5.0000%") && m.contains("10.0000%") && m.contains("eu-west"));
        let e = LedgerError::StaleEpoch {
            id: 7,
            have: 7,
            got: 6,
        };
        assert_eq!(e.to_string(), "allocation 7 has epoch 7, not 6: stale");
        let e = LedgerError::AllocationEnded {
            id: 3,
            how: Ended::Forgotten,
        };
        assert!(e.to_string().contains("ended"));
        assert_eq!(Ended::Forgotten.as_str(), "forgotten");
    }
}
