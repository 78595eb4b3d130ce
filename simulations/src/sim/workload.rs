//! The simulated traffic: the policy the cluster enforces and, per workload, the arrivals each
//! agent's gateway sends (drawn from the seed). Floating point only shapes the offered load
//! (inter-arrival times, Zipf ranks); no decision depends on it.

use crate::arrivals::{Arrival, Key};
use crate::zipf::{SplitMix64, Zipf};
use allot_common::config::ConfigSet;
use allot_common::units::{Micros, MICROS_PER_TOKEN};
use std::time::Duration;

/// The policy document every node installs and every agent enforces. The acme rule is the
/// seed's contract (§1) with a calendar quota small enough to run out in one simulation; the
/// tenants rule is the many-tenants contract of issue 9.
pub const POLICY: &str = "domain: sim
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: operation
        value: search
        rate_limit:
          name: acme-search
          unit: second
          requests_per_unit: 10
          burst: 40
          algorithm: token_bucket
          scope: global
          failure_mode: deny
          quota: {limit: 150, period: day}
          lease: {ttl_ms: 2000, max_grant: 8, max_drift_ms: 250}
          regions:
            - {region: eu-west, share: \"50%\"}
            - {region: us-east, share: \"50%\"}
  - key: tenant
    rate_limit:
      name: per-tenant
      unit: second
      requests_per_unit: 20
      burst: 20
      algorithm: token_bucket
      scope: global
      failure_mode: deny
      lease: {ttl_ms: 2000, max_grant: 5, max_drift_ms: 250}
";

/// The config domain of [`POLICY`].
pub const DOMAIN: &str = "sim";

/// A key's contract as the invariants need it: burst B and rate r (tokens, tokens/s), and the
/// calendar quota (tokens per period) when it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contract {
    /// Capacity B, µtokens.
    pub burst: Micros,
    /// Rate r, µtokens per second.
    pub rate_per_s: Micros,
    /// Calendar quota, µtokens per period.
    pub quota: Option<Micros>,
    /// Lease TTL plus the allowed drift, ms: how long an allocation can be spent after its grant.
    pub lease_life_ms: u64,
}

/// The acme key's contract (from [`POLICY`]).
pub const ACME: Contract = Contract {
    burst: 40 * MICROS_PER_TOKEN,
    rate_per_s: 10 * MICROS_PER_TOKEN,
    quota: Some(150 * MICROS_PER_TOKEN),
    lease_life_ms: 2_250,
};

/// A tenant key's contract (from [`POLICY`]).
pub const TENANT: Contract = Contract {
    burst: 20 * MICROS_PER_TOKEN,
    rate_per_s: 20 * MICROS_PER_TOKEN,
    quota: None,
    lease_life_ms: 2_250,
};

/// How long an allocation of `key`'s rule can be spent after its grant under `policies`: its
/// lease ttl plus the allowed drift, ms (`None`: the key matches no rule).
pub fn lease_life_ms(policies: &ConfigSet, key: &Key) -> Option<u64> {
    let d = policies.domain(&key.domain)?;
    let rule = d.match_rule(key.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let lease = &d.rules[rule].lease;
    Some(lease.ttl_ms.saturating_add(lease.max_drift_ms))
}

/// The traffic of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// Every gateway sends acme searches at 3× the contract, with a burst of 60 at once.
    AcmeBurst,
    /// One quiet tenant well under its contract (2/s): nothing should be denied.
    Quiet,
    /// eu-west sends 2.5× the contract, us-east a trickle (regional skew, design §5).
    RegionalSkew,
    /// 1,000 tenants, Zipf(1.1) popularity, costs 1, 2 or 4 (weighted), 300 requests/s in all.
    Zipf,
}

impl Workload {
    /// Every workload, in the order seeds cycle through them.
    pub const ALL: [Workload; 4] = [
        Workload::AcmeBurst,
        Workload::Quiet,
        Workload::RegionalSkew,
        Workload::Zipf,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::AcmeBurst => "acme-burst",
            Workload::Quiet => "quiet",
            Workload::RegionalSkew => "regional-skew",
            Workload::Zipf => "zipf-1000",
        }
    }
}

/// The keys and arrivals of a run: arrivals sorted by time, each naming an agent index (of
/// `regions`) and a key index.
#[derive(Debug, Clone)]
pub struct Traffic {
    /// The keys requests use.
    pub keys: Vec<Key>,
    /// Each key's contract.
    pub contracts: Vec<Contract>,
    /// The arrivals, sorted by time.
    pub arrivals: Vec<Arrival>,
}

fn acme_key() -> Key {
    Key {
        domain: DOMAIN.into(),
        entries: vec![
            ("tenant".into(), "acme".into()),
            ("operation".into(), "search".into()),
        ],
    }
}

fn tenant_key(i: usize) -> Key {
    Key {
        domain: DOMAIN.into(),
        entries: vec![("tenant".into(), format!("t{i:04}"))],
    }
}

/// Poisson arrivals at `per_s` per second on `[from, until)` for `agent`, key index `key`.
fn poisson(
    rng: &mut SplitMix64,
    per_s: f64,
    from: Duration,
    until: Duration,
    agent: usize,
    key: usize,
    out: &mut Vec<Arrival>,
) {
    let mut t = from.as_secs_f64();
    let end = until.as_secs_f64();
    loop {
        // 1 − u lies in (0, 1]: the logarithm is finite.
        t += -(1.0 - rng.next_unit()).ln() / per_s;
        if t >= end {
            return;
        }
        out.push(Arrival {
            at: Duration::from_secs_f64(t),
            agent,
            key,
            cost: 1,
        });
    }
}

/// The traffic of `workload` for agents in `regions` (one entry per agent), on
/// `[start, until)`, drawn from `seed`.
pub fn traffic(
    workload: Workload,
    regions: &[&str],
    start: Duration,
    until: Duration,
    seed: u64,
) -> Traffic {
    let mut rng = SplitMix64::new(seed ^ 0x7472_6166_6669_6300);
    let mut arrivals = Vec::new();
    let n = regions.len().max(1) as f64;
    let (keys, contracts) = match workload {
        Workload::Zipf => (
            (0..1000).map(tenant_key).collect::<Vec<_>>(),
            vec![TENANT; 1000],
        ),
        _ => (vec![acme_key()], vec![ACME]),
    };
    match workload {
        Workload::AcmeBurst => {
            for a in 0..regions.len() {
                poisson(&mut rng, 30.0 / n, start, until, a, 0, &mut arrivals);
            }
            let burst_at = start + (until - start) / 4;
            for i in 0..60 {
                arrivals.push(Arrival {
                    at: burst_at,
                    agent: i % regions.len().max(1),
                    key: 0,
                    cost: 1,
                });
            }
        }
        Workload::Quiet => {
            for a in 0..regions.len() {
                poisson(&mut rng, 2.0 / n, start, until, a, 0, &mut arrivals);
            }
        }
        Workload::RegionalSkew => {
            let eu = regions.iter().filter(|r| **r == "eu-west").count().max(1) as f64;
            for (a, r) in regions.iter().enumerate() {
                let per_s = if *r == "eu-west" { 25.0 / eu } else { 0.5 };
                poisson(&mut rng, per_s, start, until, a, 0, &mut arrivals);
            }
        }
        Workload::Zipf => {
            let zipf = Zipf::new(1000, 1.1).expect("1000 keys and s = 1.1 are valid");
            let mut all = Vec::new();
            for a in 0..regions.len() {
                poisson(&mut rng, 300.0 / n, start, until, a, 0, &mut all);
            }
            for mut x in all {
                x.key = zipf.sample(&mut rng);
                x.cost = match rng.next_u64() % 10 {
                    0 => 4,
                    1 | 2 => 2,
                    _ => 1,
                };
                arrivals.push(x);
            }
        }
    }
    arrivals.sort_by_key(|x| (x.at, x.agent, x.key));
    Traffic {
        keys,
        contracts,
        arrivals,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_policy_is_valid_and_traffic_is_reproducible() {
        let set = ConfigSet::from_yaml(POLICY, Path::new("sim.yaml")).expect("valid policy");
        assert_eq!(lease_life_ms(&set, &acme_key()), Some(2_250));
        assert_eq!(lease_life_ms(&set, &tenant_key(7)), Some(2_250));
        let regions = ["eu-west", "us-east"];
        for w in Workload::ALL {
            let a = traffic(
                w,
                &regions,
                Duration::from_secs(1),
                Duration::from_secs(5),
                7,
            );
            let b = traffic(
                w,
                &regions,
                Duration::from_secs(1),
                Duration::from_secs(5),
                7,
            );
            assert!(!a.arrivals.is_empty(), "{w:?}");
            assert_eq!(a.arrivals, b.arrivals, "{w:?}");
            assert!(a.arrivals.windows(2).all(|p| p[0].at <= p[1].at));
        }
    }
}
