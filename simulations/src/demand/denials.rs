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
}

impl Denials {
    /// What was counted between `before` and `self` (counters only grow; a restarted agent's
    /// reset counts as 0).
    pub fn since(self, before: Denials) -> Denials {
        Denials {
            wait_timeouts: self.wait_timeouts.saturating_sub(before.wait_timeouts),
            failure_mode: self.failure_mode.saturating_sub(before.failure_mode),
            rpc_errors: self.rpc_errors.saturating_sub(before.rpc_errors),
        }
    }
}

/// Reads every agent's `/metrics` and sums the denial counters.
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
    fn since_never_goes_below_zero() {
        let a = Denials {
            wait_timeouts: 5,
            failure_mode: 1,
            rpc_errors: 9,
        };
        let b = Denials {
            wait_timeouts: 2,
            failure_mode: 4,
            rpc_errors: 9,
        };
        assert_eq!(
            a.since(b),
            Denials {
                wait_timeouts: 3,
                failure_mode: 0,
                rpc_errors: 0
            }
        );
    }
}
