//! The leader's clock tick: a `Command::Tick` proposal whenever no applied entry has moved
//! ledger time for a whole period, so allocations expire and share handoffs finish on time even
//! when no client writes.
//!
//! Every entry carries the leader's stamp, and applying any entry expires, forgets and hands
//! off exactly as a `Tick` at that stamp would (`Ledger::apply_at`). So a tick is needed only
//! where nothing else moved ledger time: under traffic the ticks cost no Raft entries (issue 9:
//! "≤ one Raft entry per agent per tick"; each was a replication round and an fsync per node),
//! and an idle cluster still ticks about once per period. The period is measured from when an
//! entry was applied, checked four times per period, so two applied stamps are at most about
//! 1¼ periods plus one commit latency apart, and the ledger's state lags real time by at most
//! that plus another commit (before: one period plus a commit). Later is the safe direction:
//! holders stop spending at their own deadlines; an allocation only expires, and its tokens
//! return, a little later.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::ledger::{Command, Ledger};
use crate::raft::Node;

/// Checks per tick period.
const CHECKS_PER_PERIOD: u32 = 4;

/// Spawns the ticker. Only the leader proposes; followers skip their turn. A tick that does not
/// commit within four periods (no quorum) is abandoned so the loop keeps its pace.
pub fn spawn_ticker(node: Arc<Node<Ledger>>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let check = (every / CHECKS_PER_PERIOD).max(Duration::from_millis(1));
        let mut interval = tokio::time::interval(check);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let is_leader = node.raft().metrics().borrow().current_leader == Some(node.id());
            if !is_leader || !tick_due(node.ledger_time().since_applied_ns(), every) {
                continue;
            }
            match tokio::time::timeout(every * 4, node.propose(Command::Tick)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "tick not committed"),
                Err(_) => tracing::debug!("tick timed out"),
            }
        }
    })
}

/// Whether the leader should propose a tick: no stamp applied on this node for a whole
/// `every` (`since_applied_ns`: real time since the last, `None` before the first).
fn tick_due(since_applied_ns: Option<u64>, every: Duration) -> bool {
    let every_ns = u64::try_from(every.as_nanos()).unwrap_or(u64::MAX);
    since_applied_ns.is_none_or(|ns| ns >= every_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tick_is_due_only_after_a_whole_period_without_an_applied_entry() {
        let every = Duration::from_millis(250);
        // Nothing applied yet (a fresh leader): tick.
        assert!(tick_due(None, every));
        // An entry applied within the period moved ledger time: no tick.
        assert!(!tick_due(Some(0), every));
        assert!(!tick_due(Some(249_999_999), every));
        // A whole period without one: tick.
        assert!(tick_due(Some(250_000_000), every));
        assert!(tick_due(Some(u64::MAX), every));
        // Extremes of the period.
        assert!(tick_due(Some(0), Duration::ZERO));
        assert!(!tick_due(Some(u64::MAX - 1), Duration::MAX));
        assert!(tick_due(Some(u64::MAX), Duration::MAX));
    }
}
