//! The leader's clock tick: a `Command::Tick` proposal at a fixed period, so allocations expire
//! and share handoffs finish on time even when no client writes.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::ledger::{Command, Ledger};
use crate::raft::Node;

/// Spawns the ticker. Only the leader proposes; followers skip their turn. A tick that does not
/// commit within four periods (no quorum) is abandoned so the loop keeps its pace.
pub fn spawn_ticker(node: Arc<Node<Ledger>>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let is_leader = node.raft().metrics().borrow().current_leader == Some(node.id());
            if !is_leader {
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
