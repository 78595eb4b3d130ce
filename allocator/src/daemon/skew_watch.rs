//! Every node's periodic clock check (issue 10 item 2): its wall clock against ledger time,
//! allowed to differ by the smallest `max_drift_ms` of the policies in force. The result is the
//! node's [`Node::clock_skew`] (reported by `ClusterStatus`) and a rate-limited warning.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::ledger::Ledger;
use crate::raft::{Node, SkewCheck};

/// The allowed skew while no policy is in force, ms: the policies' default `max_drift_ms`.
pub const DEFAULT_MAX_DRIFT_MS: u64 = 500;

/// The skew this node's clock may have against ledger time before it is warned about, ms: the
/// smallest `max_drift_ms` of the policies in force, or [`DEFAULT_MAX_DRIFT_MS`].
pub fn allowed_skew_ms(ledger: &Ledger) -> u64 {
    ledger.min_max_drift_ms().unwrap_or(DEFAULT_MAX_DRIFT_MS)
}

/// Checks `node`'s clock skew once now.
pub fn check_once(node: &Node<Ledger>) -> SkewCheck {
    let allowed = node.state().read(allowed_skew_ms);
    node.check_clock_skew(allowed)
}

/// Spawns the check on every node (leader or not: a follower's bad clock matters as soon as it
/// is elected), once per `every`.
pub fn spawn_skew_watch(node: Arc<Node<Ledger>>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            check_once(&node);
        }
    })
}
