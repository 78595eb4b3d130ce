//! Why the agents denied what they denied during a part: the change of their denial counters
//! (`/metrics`) while the part ran, so a false rejection (a request the ideal counter admits
//! and Allot denies) can be read against its cause.

use crate::local::Deployment;
use anyhow::{Context, Result};
use std::time::Duration;

/// Denials by cause, summed over the agents, as counted by the agents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Denials {
    /// Requests whose wait for an allocator call reached `cold_wait_ms`
    /// (`allot_agent_lease_wait_timeouts`).
    pub wait_timeouts: u64,
    /// Requests denied by the failure mode while the allocator was unreachable
    /// (`allot_agent_failure_denials`).
    pub failure_mode: u64,
    /// Allocator calls that failed (`allot_agent_allocator_rpc_errors`).
    pub rpc_errors: u64,
    /// Requests denied from the allocator's remembered denial without a call
    /// (`allot_agent_lease_denials_held`).
    pub held: u64,
    /// Requests denied because a rate-carrying allocation had not accrued their cost yet
    /// (`allot_agent_lease_accrual_denials`).
    pub accrual: u64,
    /// What the agents asked of the allocator meanwhile.
    pub work: Work,
}

/// The agents' allocator work during a part, summed over the agents: calls (one `Batch` is one
/// call, and at most one Raft entry), the items they carried by kind, and keys moved between
/// central decisions and leases (issue 9 items 2–3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Work {
    /// `allot_agent_allocator_calls`.
    pub calls: u64,
    /// `allot_agent_allocator_rpcs{kind="decide"}`: central decisions.
    pub decides: u64,
    /// `allot_agent_allocator_rpcs{kind="acquire"}`.
    pub acquires: u64,
    /// `allot_agent_allocator_rpcs{kind="report"}`.
    pub reports: u64,
    /// `allot_agent_allocator_rpcs{kind="release"}`.
    pub releases: u64,
    /// `allot_agent_key_moves{to="leased"}`: promotions to leases.
    pub promotions: u64,
    /// `allot_agent_key_moves{to="central"}`: demotions to central decisions.
    pub demotions: u64,
    /// `allot_agent_acquires_queued{why="prefetch"}`: Acquires of the maintenance pass.
    pub prefetch: u64,
    /// `allot_agent_acquires_queued{why="running_low"}`: Acquires of decisions running low.
    pub running_low: u64,
    /// `allot_agent_acquires_queued{why="cold"}`: Acquires of decisions finding nothing.
    pub cold: u64,
}

/// The counters of [`Work`] in field order: the `--json` figure, the agent's Prometheus counter
/// and the label selecting its series (`None`: the whole counter).
const WORK_COUNTERS: [(&str, &str, Option<&str>); 10] = [
    ("allocator_calls", "allot_agent_allocator_calls_total", None),
    ("decide_items", RPCS, Some("kind=\"decide\"")),
    ("acquire_items", RPCS, Some("kind=\"acquire\"")),
    ("report_items", RPCS, Some("kind=\"report\"")),
    ("release_items", RPCS, Some("kind=\"release\"")),
    ("promotions", MOVES, Some("to=\"leased\"")),
    ("demotions", MOVES, Some("to=\"central\"")),
    ("acquires_prefetch", QUEUED, Some("why=\"prefetch\"")),
    ("acquires_running_low", QUEUED, Some("why=\"running_low\"")),
    ("acquires_cold", QUEUED, Some("why=\"cold\"")),
];
const RPCS: &str = "allot_agent_allocator_rpcs_total";
const MOVES: &str = "allot_agent_key_moves_total";
const QUEUED: &str = "allot_agent_acquires_queued_total";

impl Work {
    /// The counts in [`WORK_COUNTERS`] order.
    fn counts(self) -> [u64; 10] {
        [
            self.calls,
            self.decides,
            self.acquires,
            self.reports,
            self.releases,
            self.promotions,
            self.demotions,
            self.prefetch,
            self.running_low,
            self.cold,
        ]
    }

    fn from_counts(c: [u64; 10]) -> Work {
        let [calls, decides, acquires, reports, releases, promotions, demotions, prefetch, running_low, cold] =
            c;
        Work {
            calls,
            decides,
            acquires,
            reports,
            releases,
            promotions,
            demotions,
            prefetch,
            running_low,
            cold,
        }
    }

    /// Each count combined with `o`'s by `f`.
    fn zip(self, o: Work, f: fn(u64, u64) -> u64) -> Work {
        let (a, b) = (self.counts(), o.counts());
        Work::from_counts(std::array::from_fn(|i| f(a[i], b[i])))
    }

    /// What was counted between `before` and `self` (saturating, as [`Denials::since`]).
    fn since(self, before: Work) -> Work {
        self.zip(before, u64::saturating_sub)
    }

    /// `self` and `o` together (saturating).
    fn plus(self, o: Work) -> Work {
        self.zip(o, u64::saturating_add)
    }

    /// The `--json` figures: (name, count).
    pub fn figures(self) -> impl Iterator<Item = (&'static str, u64)> {
        WORK_COUNTERS.iter().map(|c| c.0).zip(self.counts())
    }

    /// Adds one agent's counters from its Prometheus text.
    fn add(&mut self, text: &str) {
        let read = WORK_COUNTERS.map(|(_, name, label)| match label {
            None => counter(text, name),
            Some(l) => labelled(text, name, l),
        });
        *self = self.plus(Work::from_counts(read));
    }
}

impl Denials {
    /// What was counted between `before` and `self` (counters only grow; a restarted agent's
    /// reset counts as 0).
    pub fn since(self, before: Denials) -> Denials {
        Denials {
            wait_timeouts: self.wait_timeouts.saturating_sub(before.wait_timeouts),
            failure_mode: self.failure_mode.saturating_sub(before.failure_mode),
            rpc_errors: self.rpc_errors.saturating_sub(before.rpc_errors),
            held: self.held.saturating_sub(before.held),
            accrual: self.accrual.saturating_sub(before.accrual),
            work: self.work.since(before.work),
        }
    }

    /// `self` and `other` together (two phases of one part; saturating).
    pub fn plus(self, o: Denials) -> Denials {
        Denials {
            wait_timeouts: self.wait_timeouts.saturating_add(o.wait_timeouts),
            failure_mode: self.failure_mode.saturating_add(o.failure_mode),
            rpc_errors: self.rpc_errors.saturating_add(o.rpc_errors),
            held: self.held.saturating_add(o.held),
            accrual: self.accrual.saturating_add(o.accrual),
            work: self.work.plus(o.work),
        }
    }
}

/// Reads every agent's `/metrics` and sums the denial and work counters.
///
/// # Errors
/// An agent's `/metrics` cannot be read.
pub(crate) async fn scrape(d: &Deployment) -> Result<Denials> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut sum = Denials::default();
    for a in &d.agents {
        let text = http
            .get(format!("http://{}/metrics", a.http))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("metrics of agent {}", a.id))?
            .text()
            .await?;
        sum.wait_timeouts += counter(&text, "allot_agent_lease_wait_timeouts_total");
        sum.failure_mode += counter(&text, "allot_agent_failure_denials_total");
        sum.rpc_errors += counter(&text, "allot_agent_allocator_rpc_errors_total");
        sum.held += counter(&text, "allot_agent_lease_denials_held_total");
        sum.accrual += counter(&text, "allot_agent_lease_accrual_denials_total");
        sum.work.add(&text);
    }
    Ok(sum)
}

/// The sum of the samples of the counter `name` in Prometheus text (0 when absent).
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The sum of the samples of the counter `name` whose labels include `label` (`k="v"`).
fn labelled(text: &str, name: &str, label: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('{'))
                .and_then(|rest| rest.split_once('}'))
                .is_some_and(|(labels, _)| labels.split(',').any(|x| x == label))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_is_summed_over_its_samples_and_no_other_name() {
        let text = "# HELP allot_agent_failure_denials_total x\n\
                    allot_agent_failure_denials_total{otel_scope_name=\"allot\"} 3\n\
                    allot_agent_failure_denials_total 2\n\
                    allot_agent_failure_denials_total_other 7\n";
        assert_eq!(counter(text, "allot_agent_failure_denials_total"), 5);
        assert_eq!(counter(text, "allot_agent_lease_wait_timeouts_total"), 0);
    }

    #[test]
    fn labelled_counters_are_read_by_label() {
        let text =
            "allot_agent_allocator_rpcs_total{kind=\"decide\",otel_scope_name=\"allot\"} 7\n\
                    allot_agent_allocator_rpcs_total{kind=\"report\"} 3\n\
                    allot_agent_allocator_calls_total 4\n\
                    allot_agent_key_moves_total{to=\"leased\"} 2\n\
                    allot_agent_acquires_queued_total{why=\"cold\"} 5\n";
        let mut w = Work::default();
        w.add(text);
        w.add(text);
        assert_eq!(
            w,
            Work {
                calls: 8,
                decides: 14,
                reports: 6,
                promotions: 4,
                cold: 10,
                ..Work::default()
            }
        );
        assert_eq!(w.since(w), Work::default());
        assert_eq!(w.plus(w).since(w), w);
    }

    #[test]
    fn since_never_goes_below_zero() {
        let a = Denials {
            wait_timeouts: 5,
            failure_mode: 1,
            rpc_errors: 9,
            held: 7,
            accrual: 2,
            work: Work::default(),
        };
        let b = Denials {
            wait_timeouts: 2,
            failure_mode: 4,
            rpc_errors: 9,
            held: 3,
            accrual: 6,
            work: Work::default(),
        };
        assert_eq!(
            a.since(b),
            Denials {
                wait_timeouts: 3,
                failure_mode: 0,
                rpc_errors: 0,
                held: 4,
                accrual: 0,
                work: Work::default(),
            }
        );
    }
}
