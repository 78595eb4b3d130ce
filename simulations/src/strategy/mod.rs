//! The strategy table (issue 12 item 4) and the lease sweep (item 5): the deterministic
//! simulation of [`crate::sim`] run with the same workloads and the same fault schedule for
//! several ways of enforcing one global limit, each realised with production code:
//!
//! - (a) independent local buckets per gateway: the agents enforce the rules with
//!   `scope: local` (the decision core's own buckets), whole limit per gateway; (a′) the same
//!   with the limit divided evenly between the gateways;
//! - (b) a static regional split: Allot with `shares_mode: cap` (each region's 50 % is a hard
//!   cap, design §5);
//! - (c) a synchronous central counter: Allot's central `Decide` for every request (the agents'
//!   `promote_tokens` is `u64::MAX`, so no key is ever leased);
//! - (d) Allot's leases with production's defaults.
//!
//! [`measure`] turns a run into the table's figures, [`plot`] draws them, [`doc`] writes
//! `docs/strategies.md`, [`sweep`] varies the lease size and report interval.

pub mod compare;
pub mod doc;
pub mod measure;
pub mod plot;
pub mod sweep;

use crate::sim::faults::{Fault, FaultKind};
use crate::sim::workload::{Contract, Workload};
use crate::sim::world::AGENT_REGIONS;
use crate::sim::{LeaseTuning, Network, SimConfig};
use allot_common::config::Scope;
use std::fmt::Write as _;

/// Round trip between two hosts of one region, µs (issue 12 item 4).
pub const IN_REGION_RTT_US: u64 = 200;
/// Round trip between regions, µs.
pub const ACROSS_RTT_US: u64 = 70_000;
/// The allocator partition of the schedule: every agent cut off from every allocator node, ms.
pub const PARTITION_MS: (u64, u64) = (7_500, 9_500);
/// Simulated length of a strategy run, ms (traffic from 2 s to 11.5 s).
pub const DURATION_MS: u64 = 12_000;

/// A way to enforce one global limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// (a) Each gateway enforces the whole limit with its own bucket.
    LocalWhole,
    /// (a′) Each gateway enforces 1/N of the limit with its own bucket.
    LocalSplit,
    /// (b) A static regional split: hard regional caps.
    RegionalSplit,
    /// (c) One synchronous central decision per request.
    Central,
    /// (d) Allot's leases.
    Leases,
}

impl Strategy {
    /// Every strategy, in table order.
    pub const ALL: [Strategy; 5] = [
        Strategy::LocalWhole,
        Strategy::LocalSplit,
        Strategy::RegionalSplit,
        Strategy::Central,
        Strategy::Leases,
    ];

    /// Its name in commands and file names.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::LocalWhole => "local-whole",
            Strategy::LocalSplit => "local-split",
            Strategy::RegionalSplit => "regional-split",
            Strategy::Central => "central",
            Strategy::Leases => "leases",
        }
    }

    /// Its label in the table.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::LocalWhole => "(a) local buckets, whole limit each",
            Strategy::LocalSplit => "(a′) local buckets, limit / N each",
            Strategy::RegionalSplit => "(b) static regional split",
            Strategy::Central => "(c) synchronous central counter",
            Strategy::Leases => "(d) Allot leases (defaults)",
        }
    }

    /// How it is realised, for the doc.
    pub fn how(self) -> &'static str {
        match self {
            Strategy::LocalWhole => {
                "every agent enforces the policy with `scope: local` (production's \
                 `ConfigSet::with_scope(Scope::Local)`): the decision core's own bucket of the \
                 whole B and r in each of the N = 4 agents, no allocator call. The calendar \
                 quota is not enforced locally (only the allocator keeps one)."
            }
            Strategy::LocalSplit => {
                "the same, with the agents' document dividing the limit evenly: acme 150/min \
                 (2.5/s) with burst 10, a tenant 300/min (5/s) with burst 5 per agent, so the N \
                 buckets sum to the contract."
            }
            Strategy::RegionalSplit => {
                "Allot (allocator and agents unchanged) with `shares_mode: cap`: each region's \
                 50 % share of B and r is a hard cap (design §5), leased within the region; the \
                 per-tenant rule gets the same 50/50 caps."
            }
            Strategy::Central => {
                "Allot with the agents' `promote_tokens` set to `u64::MAX`: no key is ever \
                 promoted to leases, so every request is one `Decide` on the allocator \
                 (batched with concurrent ones in one RPC), debited and committed through Raft \
                 before the answer."
            }
            Strategy::Leases => {
                "Allot as shipped: the agents' default `LeaseSettings` (report every 1 000 ms, \
                 promote at 4 tokens per lease period) and the policy's default lease section \
                 (ttl 5 000 ms, max grant B/4, max drift 500 ms)."
            }
        }
    }

    /// The run of `workload` under this strategy, seeded by the caller.
    pub fn config(self, workload: Workload) -> SimConfig {
        let base = base_config(workload);
        match self {
            Strategy::LocalWhole => SimConfig {
                agent_scope: Some(Scope::Local),
                ..base
            },
            Strategy::LocalSplit => SimConfig {
                agent_policy: Some(policy(&PolicyShape {
                    split: AGENT_REGIONS.len() as u64,
                    ..PolicyShape::default()
                })),
                agent_scope: Some(Scope::Local),
                ..base
            },
            Strategy::RegionalSplit => SimConfig {
                policy: policy(&PolicyShape {
                    cap: true,
                    ..PolicyShape::default()
                }),
                ..base
            },
            Strategy::Central => SimConfig {
                tuning: LeaseTuning {
                    promote_tokens: Some(u64::MAX),
                    ..LeaseTuning::default()
                },
                ..base
            },
            Strategy::Leases => base,
        }
    }

    /// Whether the strategy is Allot's allocator (it reports a bound).
    pub fn reports_bound(self) -> bool {
        matches!(
            self,
            Strategy::RegionalSplit | Strategy::Central | Strategy::Leases
        )
    }
}

/// The run every strategy shares: 3 allocator nodes in eu-west, agents 2 + 2 in eu-west and
/// us-east, modelled round trips, the fixed fault schedule, product-default leases.
pub fn base_config(workload: Workload) -> SimConfig {
    SimConfig {
        duration_ms: DURATION_MS,
        traffic_from_ms: 2_000,
        nodes: 3,
        faults: true,
        workload: Some(workload),
        only: Vec::new(),
        schedule: Some(schedule()),
        policy: policy(&PolicyShape::default()),
        agent_policy: None,
        agent_scope: None,
        tuning: LeaseTuning::default(),
        network: Network::Regions {
            in_region_rtt_us: IN_REGION_RTT_US,
            across_rtt_us: ACROSS_RTT_US,
        },
    }
}

/// The fault schedule every strategy run plays, one fault at a time so that each one's effect
/// shows apart from the others and from the acme burst at 4 375 ms: a leader change (the
/// cluster is without a leader for about a second), a follower's crash and restart from its
/// data, and the allocator partition (every agent cut off from every node for 2 s).
pub fn schedule() -> Vec<Fault> {
    let fault = |kind, at_ms, until_ms, target| Fault {
        kind,
        at_ms,
        until_ms,
        target,
        amount: 0,
    };
    let mut s = vec![
        fault(FaultKind::LeaderChange, 3_000, 3_100, 0),
        fault(FaultKind::NodeCrash, 5_200, 6_700, 2),
    ];
    for agent in 0..AGENT_REGIONS.len() {
        s.push(fault(
            FaultKind::PartitionAgent,
            PARTITION_MS.0,
            PARTITION_MS.1,
            agent,
        ));
    }
    s
}

/// The knobs of the strategies' policy document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyShape {
    /// `lease: {ttl_ms, max_grant}` (tokens); `None`: production's defaults.
    pub lease: Option<(u64, u64)>,
    /// Regional shares are hard caps (`shares_mode: cap`), the tenant rule split 50/50 too.
    pub cap: bool,
    /// Each rule's rate and burst divided by this (a gateway's part); 1: the contract.
    pub split: u64,
}

impl Default for PolicyShape {
    fn default() -> Self {
        PolicyShape {
            lease: None,
            cap: false,
            split: 1,
        }
    }
}

/// The policy document of the strategy runs: the contracts of `sim::workload::POLICY` (acme
/// 10/s, burst 40, 150 a day, eu-west and us-east 50 % each; a tenant 20/s, burst 20), with the
/// lease section, share mode and split of `shape`. Rates are written per minute so that a
/// split part stays whole.
pub fn policy(shape: &PolicyShape) -> String {
    let n = shape.split.max(1);
    debug_assert!(600 % n == 0 && 40 % n == 0 && 1_200 % n == 0 && 20 % n == 0);
    let lease = match shape.lease {
        Some((ttl, grant)) => format!("lease: {{ttl_ms: {ttl}, max_grant: {grant}}}"),
        None => String::new(),
    };
    let regions = "regions:\n            - {region: eu-west, share: \"50%\"}\n            \
                   - {region: us-east, share: \"50%\"}";
    let mode = if shape.cap { "shares_mode: cap" } else { "" };
    let mut y = String::from("domain: sim\ndescriptors:\n");
    let _ = write!(
        y,
        "  - key: tenant
    value: acme
    descriptors:
      - key: operation
        value: search
        rate_limit:
          name: acme-search
          unit: minute
          requests_per_unit: {}
          burst: {}
          algorithm: token_bucket
          scope: global
          failure_mode: deny
          quota: {{limit: 150, period: day}}
          {lease}
          {regions}
          {mode}
  - key: tenant
    rate_limit:
      name: per-tenant
      unit: minute
      requests_per_unit: {}
      burst: {}
      algorithm: token_bucket
      scope: global
      failure_mode: deny
      {lease}
",
        600 / n,
        40 / n,
        1_200 / n,
        20 / n
    );
    if shape.cap {
        let _ = write!(
            y,
            "      regions:\n        - {{region: eu-west, share: \"50%\"}}\n        \
             - {{region: us-east, share: \"50%\"}}\n      shares_mode: cap\n"
        );
    }
    y
}

/// Each key's contract in a run of `workload` (the same for every strategy).
pub fn contracts(workload: Workload) -> Vec<Contract> {
    use crate::sim::workload::{ACME, TENANT};
    match workload {
        Workload::Zipf => vec![TENANT; 1_000],
        _ => vec![ACME],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::workload::{ACME, POLICY, TENANT};
    use allot_common::config::{ConfigSet, RuleLimit};
    use std::path::Path;

    fn limits(yaml: &str) -> Vec<(u64, u64, Option<u64>)> {
        let set = ConfigSet::from_yaml(yaml, Path::new("t.yaml")).expect("valid policy");
        let d = set.domain("sim").expect("domain sim");
        d.rules
            .iter()
            .map(|r| match r.limit {
                RuleLimit::Limited { params, .. } => (
                    params.capacity(),
                    params.refill_rate().part_per_s(1_000_000),
                    r.quota.map(|q| q.limit),
                ),
                RuleLimit::Unlimited => (0, 0, None),
            })
            .collect()
    }

    #[test]
    fn every_strategy_policy_keeps_the_workloads_contracts() {
        let contract = limits(POLICY);
        assert_eq!(
            contract,
            vec![
                (ACME.burst, ACME.rate_per_s, ACME.quota),
                (TENANT.burst, TENANT.rate_per_s, None)
            ]
        );
        for shape in [
            PolicyShape::default(),
            PolicyShape {
                cap: true,
                ..PolicyShape::default()
            },
            PolicyShape {
                lease: Some((2_000, 8)),
                ..PolicyShape::default()
            },
        ] {
            assert_eq!(limits(&policy(&shape)), contract, "{shape:?}");
        }
        let split = limits(&policy(&PolicyShape {
            split: 4,
            ..PolicyShape::default()
        }));
        assert_eq!(split[0].0 * 4, ACME.burst);
        assert_eq!(split[0].1 * 4, ACME.rate_per_s);
        assert_eq!(split[1].0 * 4, TENANT.burst);
    }

    #[test]
    fn every_strategy_plays_the_same_schedule() {
        for s in Strategy::ALL {
            let c = s.config(Workload::AcmeBurst);
            assert_eq!(c.schedule.as_deref(), Some(&schedule()[..]), "{s:?}");
            assert_eq!(c.duration_ms, DURATION_MS);
        }
    }
}
