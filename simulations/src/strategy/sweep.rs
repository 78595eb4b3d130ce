//! The sweep of lease size and report interval (issue 12 item 5): Allot's leases on the same
//! schedule and network as the strategy table, with the policy's `lease.max_grant` b and the
//! agents' `report_interval_ms` Δ varied (and, at the defaults, `lease.ttl_ms`), measured
//! against the batch bound N·b and the delay bound Σ rᵢ·Δ (design §6).

use super::measure::{measure, Measured};
use super::{contracts, PolicyShape, Strategy, PARTITION_MS};
use crate::arrivals::RequestAnswer;
use crate::sim::workload::Workload;
use crate::sim::world::AGENT_REGIONS;
use crate::sim::{run, LeaseTuning, RunReport, SimConfig};
use allot_common::units::{Micros, MICROS_PER_TOKEN};
use anyhow::Result;

/// Max grants swept, tokens (the acme contract's B is 40; production's default is B/4 = 10).
pub const GRANTS: [u64; 6] = [1, 2, 5, 10, 20, 40];
/// Report intervals swept, ms (production's default is 1 000).
pub const REPORTS_MS: [u64; 4] = [250, 500, 1_000, 2_000];
/// Lease ttls swept at the default grant and interval, ms (production's default is 5 000).
pub const TTLS_MS: [u64; 4] = [1_000, 2_000, 5_000, 10_000];
/// Production's defaults for the acme contract: b = B/4, Δ, ttl.
pub const DEFAULTS: (u64, u64, u64) = (10, 1_000, 5_000);

/// One point of the sweep.
#[derive(Debug, Clone)]
pub struct Point {
    /// The workload.
    pub workload: Workload,
    /// `lease.max_grant` b, tokens.
    pub max_grant: u64,
    /// `report_interval_ms` Δ.
    pub report_ms: u64,
    /// `lease.ttl_ms`.
    pub ttl_ms: u64,
    /// N·b, µtokens (N agents).
    pub batch_bound: Micros,
    /// Σ rᵢ·Δ measured: the most the agents admitted within any window of Δ, µtokens.
    pub delay_bound: Micros,
    /// The most spent and not yet reported at one instant (summed over agents), µtokens.
    pub max_unreported: Micros,
    /// The run's figures.
    pub measured: Measured,
}

/// The run of `workload` under Allot's leases with grant `b` (tokens), report interval and ttl.
pub fn config(workload: Workload, b: u64, report_ms: u64, ttl_ms: u64) -> SimConfig {
    let base = Strategy::Leases.config(workload);
    SimConfig {
        policy: super::policy(&PolicyShape {
            lease: Some((ttl_ms, b)),
            ..PolicyShape::default()
        }),
        tuning: LeaseTuning {
            report_interval_ms: Some(report_ms),
            ..base.tuning
        },
        ..base
    }
}

/// Every (b, Δ) of the grid at the default ttl, then every ttl at the default b and Δ.
pub fn grid() -> Vec<(u64, u64, u64)> {
    let mut g = Vec::new();
    for b in GRANTS {
        for d in REPORTS_MS {
            g.push((b, d, DEFAULTS.2));
        }
    }
    for ttl in TTLS_MS.into_iter().filter(|t| *t != DEFAULTS.2) {
        g.push((DEFAULTS.0, DEFAULTS.1, ttl));
    }
    g
}

/// Runs the sweep of `points` ((b, Δ, ttl)) on `workloads` with `seed`.
///
/// # Errors
/// A run could not be set up.
pub fn sweep(
    seed: u64,
    workloads: &[Workload],
    points: &[(u64, u64, u64)],
    mut progress: impl FnMut(&Point),
) -> Result<Vec<Point>> {
    let mut out = Vec::new();
    for &workload in workloads {
        let contracts = contracts(workload);
        for &(b, report_ms, ttl_ms) in points {
            let r = run(seed, &config(workload, b, report_ms, ttl_ms))?;
            let p = Point {
                workload,
                max_grant: b,
                report_ms,
                ttl_ms,
                batch_bound: AGENT_REGIONS.len() as u64 * b * MICROS_PER_TOKEN,
                delay_bound: most_in_window(&r, report_ms),
                max_unreported: r.max_unreported,
                measured: measure(&r, &contracts, PARTITION_MS),
            };
            progress(&p);
            out.push(p);
        }
    }
    Ok(out)
}

/// The most cost admitted within any window of `window_ms` (every key), µtokens: Σ rᵢ·Δ for
/// the rates the agents actually admitted at.
fn most_in_window(r: &RunReport, window_ms: u64) -> Micros {
    let admitted: Vec<(u64, Micros)> = r
        .records
        .iter()
        .filter(|x| x.answer == RequestAnswer::Admitted)
        .map(|x| (x.sent_ns, u64::from(x.cost) * MICROS_PER_TOKEN))
        .collect();
    let mut sorted = admitted;
    sorted.sort_by_key(|(t, _)| *t);
    let window = window_ms * 1_000_000;
    let (mut start, mut sum, mut best) = (0usize, 0u64, 0u64);
    for end in 0..sorted.len() {
        sum += sorted[end].1;
        while sorted[end].0 - sorted[start].0 >= window {
            sum -= sorted[start].1;
            start += 1;
        }
        best = best.max(sum);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_holds_the_defaults_once_and_every_ttl() {
        let g = grid();
        assert_eq!(g.len(), GRANTS.len() * REPORTS_MS.len() + TTLS_MS.len() - 1);
        assert_eq!(g.iter().filter(|p| **p == DEFAULTS).count(), 1);
        for ttl in TTLS_MS {
            assert!(g.contains(&(DEFAULTS.0, DEFAULTS.1, ttl)));
        }
        let c = config(Workload::AcmeBurst, 5, 250, 2_000);
        assert!(c.policy.contains("lease: {ttl_ms: 2000, max_grant: 5}"));
        assert_eq!(c.tuning.report_interval_ms, Some(250));
    }
}
