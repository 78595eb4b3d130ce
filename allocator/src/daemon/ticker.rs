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
//!
//! What a tick must do on time is expire allocations: everything else a tick at a stamp does —
//! forgetting remembered answers, ended allocations and keys idle for a minute — is bookkeeping
//! whose moment already depended on when entries happened to come, and may come later. Later
//! changes only which request finds such a thing forgotten: a retried Release of an ended
//! allocation may be answered as released rather than as ended-and-forgotten (both tell the holder
//! it is over), and a key idle for a minute may be kept, not forgotten and created afresh, when its
//! next request comes (its bucket is full either way; a new key counts as fresh in the regional
//! division, §5). So a period without an applied entry proposes a tick only when the earliest live
//! allocation's `dead_at` has come by ledger time, when this leader has applied no stamp of its own
//! term yet (its first tick anchors ledger time in the new term, `raft::ledger_time`), or when
//! [`HYGIENE_PERIODS`] periods passed without any entry. Between the bursts of agents that renew
//! together once a report interval, the quiet quarter-seconds no longer cost an entry each (issue
//! 9, lease traffic: about 2 of the 10 entries a second of `lease-acme` were such ticks).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::ledger::{Command, Ledger};
use crate::raft::Node;

/// Checks per tick period.
const CHECKS_PER_PERIOD: u32 = 4;

/// Periods without any applied entry after which a tick is proposed even with nothing to
/// expire, so an idle cluster still forgets what it remembers (module docs).
pub const HYGIENE_PERIODS: u32 = 8;

/// Spawns the ticker. Only the leader proposes; followers skip their turn. A tick that does not
/// commit within four periods (no quorum) is abandoned so the loop keeps its pace.
pub fn spawn_ticker(node: Arc<Node<Ledger>>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let check = (every / CHECKS_PER_PERIOD).max(Duration::from_millis(1));
        let mut interval = tokio::time::interval(check);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let (leader, term) = {
                let m = node.raft().metrics();
                let m = m.borrow();
                (m.current_leader, m.current_term)
            };
            if leader != Some(node.id()) {
                continue;
            }
            let time = node.ledger_time();
            let anchored = time.term() == Some(term);
            let expiring = || expiry_due(node.state().read(|l| l.next_expiry_ms()), time.now_ms());
            if !tick_wanted(time.since_applied_ns(), every, anchored, expiring) {
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

/// Whether the leader should propose a tick now, `since_applied_ns` after its last applied stamp
/// that moved ledger time (`None`: none yet): only after a whole period `every` without one, and
/// then only when its own term has no stamp yet (`anchored` false), an allocation is due to
/// expire (`expiring`, asked last: it reads the ledger), or [`HYGIENE_PERIODS`] periods passed.
fn tick_wanted(
    since_applied_ns: Option<u64>,
    every: Duration,
    anchored: bool,
    expiring: impl FnOnce() -> bool,
) -> bool {
    tick_due(since_applied_ns, every)
        && (!anchored
            || tick_due(since_applied_ns, every.saturating_mul(HYGIENE_PERIODS))
            || expiring())
}

/// Whether the earliest live allocation's `dead_at` (`next`, Unix ms; `None`: none live) has
/// come by ledger time `now` (`None` before this node applied any stamp: then a tick is what
/// starts ledger time).
fn expiry_due(next: Option<u64>, now: Option<u64>) -> bool {
    match (next, now) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(dead_at), Some(now)) => dead_at <= now,
    }
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

    #[test]
    fn a_quiet_leader_ticks_for_its_first_stamp_an_expiry_or_hygiene() {
        let every = Duration::from_millis(250);
        let ms = |n: u64| Some(n * 1_000_000);
        let never = || -> bool { panic!("the ledger is not read") };
        // Within a period of an applied stamp: never, and the ledger is not read.
        assert!(!tick_wanted(ms(249), every, false, never));
        // A quiet period with nothing due: no tick, until eight periods passed.
        assert!(!tick_wanted(ms(250), every, true, || false));
        assert!(!tick_wanted(ms(1_999), every, true, || false));
        assert!(tick_wanted(ms(2_000), every, true, never));
        // An allocation due to expire: a tick after one period.
        assert!(tick_wanted(ms(250), every, true, || true));
        // A leader with no stamp of its own term yet: a tick after one period, whatever is due.
        assert!(tick_wanted(ms(250), every, false, never));
        // Nothing applied yet: a tick at once.
        assert!(tick_wanted(None, every, true, || false));
        // Extremes: the hygiene period saturates instead of overflowing.
        assert!(!tick_wanted(
            Some(u64::MAX - 1),
            Duration::MAX,
            false,
            never
        ));
        assert!(tick_wanted(Some(u64::MAX), Duration::MAX, true, || false));
    }

    #[test]
    fn a_quiet_period_ticks_only_for_an_allocation_due_to_expire() {
        // No stamp applied yet: tick, whatever is live.
        assert!(expiry_due(None, None));
        assert!(expiry_due(Some(5), None));
        // Nothing live: nothing to expire.
        assert!(!expiry_due(None, Some(1_000)));
        // The earliest dead_at has come (at or before ledger time), or not yet.
        assert!(expiry_due(Some(1_000), Some(1_000)));
        assert!(expiry_due(Some(999), Some(1_000)));
        assert!(!expiry_due(Some(1_001), Some(1_000)));
        // Extremes.
        assert!(expiry_due(Some(0), Some(0)));
        assert!(!expiry_due(Some(u64::MAX), Some(u64::MAX - 1)));
        assert!(expiry_due(Some(u64::MAX), Some(u64::MAX)));
    }
}
