//! The leader's clock tick: a `Command::Tick` proposal when no entry was applied for a whole
//! period, so allocations expire and share handoffs finish on time even when no client writes.
//!
//! Every stamped entry advances ledger time exactly as a `Tick` does (the ledger expires
//! allocations and finishes handoffs at each command's stamp before applying it), so a busy
//! leader proposes no ticks at all: its Raft entries are the agents' batches (design §8; issue
//! 9, lease traffic), and ledger time still lags real time by at most about one period.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::ledger::{Command, Ledger};
use crate::raft::Node;

/// Spawns the ticker. Only the leader proposes; followers skip their turn. A tick that does not
/// commit within four periods (no quorum) is abandoned so the loop keeps its pace.
pub fn spawn_ticker(node: Arc<Node<Ledger>>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut wait = every;
        loop {
            tokio::time::sleep(wait).await;
            let is_leader = node.raft().metrics().borrow().current_leader == Some(node.id());
            if !is_leader {
                wait = every;
                continue;
            }
            let since = node.ledger_time().since_applied_ns();
            wait = until_due(since, every);
            if !wait.is_zero() {
                continue;
            }
            match tokio::time::timeout(every * 4, node.propose(Command::Tick)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "tick not committed"),
                Err(_) => tracing::debug!("tick timed out"),
            }
            wait = every;
        }
    })
}

/// How long the ticker may still wait when this node last applied a stamped entry `since_ns`
/// ago (`None`: never): zero when a whole period `every` has passed (a tick is due), else the
/// rest of that period.
fn until_due(since_ns: Option<u64>, every: Duration) -> Duration {
    let Some(since_ns) = since_ns else {
        return Duration::ZERO;
    };
    every.saturating_sub(Duration::from_nanos(since_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tick_is_due_only_after_a_whole_period_without_an_applied_entry() {
        let every = Duration::from_millis(250);
        assert_eq!(until_due(None, every), Duration::ZERO, "nothing applied yet");
        assert_eq!(until_due(Some(0), every), every);
        assert_eq!(
            until_due(Some(100_000_000), every),
            Duration::from_millis(150)
        );
        assert_eq!(until_due(Some(250_000_000), every), Duration::ZERO);
        assert_eq!(until_due(Some(u64::MAX), every), Duration::ZERO);
        assert_eq!(until_due(Some(5), Duration::ZERO), Duration::ZERO);
    }
}
