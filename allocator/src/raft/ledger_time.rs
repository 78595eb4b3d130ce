//! The time a node stamps into the entries it proposes: ledger time never runs faster than real
//! time (design §6 "Clocks", issue 10 item 2).
//!
//! The ledger applies each entry at the time stamped into it, so the stamp *is* ledger time:
//! buckets refill and allocations expire by it. A wall clock alone is not good enough: a new
//! leader whose clock is X ahead would refill every bucket by min(B, r·X) at once and expire live
//! allocations early, and one with a far-future clock would push ledger time so far ahead that
//! every later leader's stamp is clamped to it (no refill until real time catches up).
//!
//! So each node keeps an **anchor**: a stamp it applied and its own monotonic time when it
//! applied it. Ledger time cannot have advanced by more than the real time elapsed since then,
//! so the node's **ceiling** is `anchor stamp + monotonic time elapsed since the anchor`, and the
//! stamp it proposes is
//!
//! ```text
//! stamp = max(last applied stamp, min(wall, ceiling))     with an anchor, wall ≥ last stamp
//! stamp = ceiling                                         with an anchor, wall < last stamp
//! stamp = max(last applied stamp, wall)                   before this node applied any stamp
//! ```
//!
//! The second line keeps ledger time moving when it is already ahead of this node's wall clock
//! (a fresh cluster's first leader had a clock far ahead, or this node's clock is behind): it
//! advances at the real rate this node measures instead of standing still until the wall clock
//! catches up, so no bucket stops refilling. It can never run faster than real time either way.
//!
//! Of the stamps a node applied **from one leader's term**, the anchor is the one that allows the
//! most (the greatest `stamp − monotonic time of apply`): a later entry of the term only moves it
//! when its stamp lies above the ceiling the node had at that moment. Anchoring on the *last*
//! entry instead would lose the commit latency at every entry (a stamp made at t is applied at
//! t + c), and ledger time would fall ever further behind under load. A restarted node anchors on
//! the stamps it restores and replays, at its monotonic time of loading them: the downtime is not
//! counted, so after a whole-cluster outage ledger time resumes where it stopped and runs at real
//! rate from there.
//!
//! The first stamp of a **new term** replaces the anchor instead of joining it. One term's stamps
//! come from one leader and never exceed that leader's ceiling, so an anchor drawn from them allows
//! no more than the leader itself could stamp; an anchor kept from an *earlier* term may allow far
//! more. A leader restarted with its downtime uncounted stamps behind real time (by the downtime);
//! a follower still anchored on the term before would, once elected, stamp at real time again:
//! ledger time would jump ahead by the downtime at once, expiring allocations whose holders may
//! still spend them for a whole lease (and refilling buckets by r · downtime). `allot-sim --seed
//! 115` found exactly that: a 2.4 s jump across a leader change after a node crash. Starting the
//! anchor afresh at each term costs one commit latency per leader change, nothing per entry.
//!
//! The anchor is node-local bookkeeping beside the state machine; `apply` itself still takes
//! its time only from the entry, so every replica computes the same state.

use std::sync::Arc;

use parking_lot::Mutex;

use super::node_clock::NodeClock;

/// Nanoseconds per millisecond.
const NANOS_PER_MS: u64 = 1_000_000;

/// A stamp this node applied and its monotonic time when it applied it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    /// The applied stamp, Unix ms.
    pub stamp_ms: u64,
    /// This node's monotonic clock when it applied it, ns.
    pub mono_ns: u64,
}

impl Anchor {
    /// The latest ledger time real time allows at monotonic `now_ns`: the anchor's stamp plus
    /// the whole milliseconds elapsed since it (none when `now_ns` is not later), saturating at
    /// `u64::MAX`. Rounds down, so it never exceeds the exact bound.
    pub fn ceiling_ms(self, now_ns: u64) -> u64 {
        let elapsed_ms = now_ns.saturating_sub(self.mono_ns) / NANOS_PER_MS;
        self.stamp_ms.saturating_add(elapsed_ms)
    }

    /// Whether this anchor allows more than `other` at every instant: a greater
    /// `stamp − monotonic time`, compared exactly in nanoseconds (u128, no overflow).
    fn allows_more_than(self, other: Anchor) -> bool {
        let ns = |ms: u64| u128::from(ms) * u128::from(NANOS_PER_MS);
        ns(self.stamp_ms) + u128::from(other.mono_ns)
            > ns(other.stamp_ms) + u128::from(self.mono_ns)
    }
}

/// The stamp to propose (Unix ms) given this node's `wall_ms`, the last applied stamp
/// `last_ms`, its anchor (`None` before it applied any stamp) and its monotonic `now_ns`:
/// `max(last_ms, min(wall_ms, ceiling))`; the ceiling itself when the wall clock is behind
/// `last_ms` (ledger time then runs at real rate rather than freezing); `max(last_ms, wall_ms)`
/// without an anchor. Never below `last_ms`; never above the ceiling unless `last_ms` already is.
pub fn next_stamp(wall_ms: u64, last_ms: u64, anchor: Option<Anchor>, now_ns: u64) -> u64 {
    let bounded = match anchor {
        Some(a) if wall_ms < last_ms => a.ceiling_ms(now_ns),
        Some(a) => wall_ms.min(a.ceiling_ms(now_ns)),
        None => wall_ms,
    };
    bounded.max(last_ms)
}

/// The anchor after applying `applied`: `applied` when there was none or it allows more than
/// `previous` (its stamp lies above the ceiling `previous` gives at its time), else `previous`.
pub fn merge_anchor(previous: Option<Anchor>, applied: Anchor) -> Anchor {
    match previous {
        Some(p) if !applied.allows_more_than(p) => p,
        _ => applied,
    }
}

/// The anchor after applying `applied` from an entry of leader term `term` (`None`: a restored
/// or installed stamp, of no known term) when the anchor was `previous`, drawn from entries of
/// `previous_term`: within one term, the one that allows more ([`merge_anchor`]); across terms
/// (or without a term), `applied` alone, so no earlier leader's anchor outlives its term.
pub fn next_anchor(
    previous: Option<Anchor>,
    previous_term: Option<u64>,
    applied: Anchor,
    term: Option<u64>,
) -> Anchor {
    match term {
        Some(t) if previous_term == Some(t) => merge_anchor(previous, applied),
        _ => applied,
    }
}

/// What a node knows about ledger time: the last stamp it applied, its anchor and the leader term
/// the anchor was drawn from (`None`: a restored or installed stamp).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Known {
    last_ms: u64,
    anchor: Option<Anchor>,
    term: Option<u64>,
    /// This node's monotonic time of its last record, ns (`None` before the first).
    recorded_ns: Option<u64>,
}

/// One node's view of ledger time: fed by its state machine as it applies stamps, read by its
/// proposers. Cheap to share (`Arc`); every method takes a short internal lock.
pub struct LedgerTime {
    clock: Arc<dyn NodeClock>,
    known: Mutex<Known>,
}

impl std::fmt::Debug for LedgerTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerTime")
            .field("known", &*self.known.lock())
            .finish_non_exhaustive()
    }
}

impl LedgerTime {
    /// A view with nothing applied yet, reading `clock`.
    pub fn new(clock: Arc<dyn NodeClock>) -> Self {
        Self {
            clock,
            known: Mutex::new(Known::default()),
        }
    }

    /// The clock this view reads.
    pub fn clock(&self) -> &Arc<dyn NodeClock> {
        &self.clock
    }

    /// The leader term of the last stamp this node applied (`None`: none yet, or a restored or
    /// installed one). A leader whose own term is not this yet anchors nothing of its own, so
    /// its ticker proposes a tick at once (module docs: the anchor starts afresh each term).
    pub fn term(&self) -> Option<u64> {
        self.known.lock().term
    }

    /// Records that the state machine restored, or installed from a snapshot, ledger time
    /// `stamp_ms` now: the anchor starts afresh there. A stamp of 0 is no time at all (nothing
    /// stamped yet) and anchors nothing.
    pub fn applied(&self, stamp_ms: u64) {
        self.record(stamp_ms, None);
    }

    /// Records that the state machine applied ledger time `stamp_ms` now, from an entry of leader
    /// term `term` (see [`next_anchor`]: the first stamp of a new term replaces the anchor).
    pub fn applied_in_term(&self, stamp_ms: u64, term: u64) {
        self.record(stamp_ms, Some(term));
    }

    fn record(&self, stamp_ms: u64, term: Option<u64>) {
        if stamp_ms == 0 {
            return;
        }
        let now_ns = self.clock.monotonic_ns();
        let mut k = self.known.lock();
        if stamp_ms > k.last_ms {
            // Ledger time moved: what the ticker waits on. A stamp at or behind it (replayed,
            // an earlier term's entries committed late) moves nothing a tick would.
            k.recorded_ns = Some(now_ns);
        }
        k.last_ms = k.last_ms.max(stamp_ms);
        let applied = Anchor {
            stamp_ms,
            mono_ns: now_ns,
        };
        k.anchor = Some(next_anchor(k.anchor, k.term, applied, term));
        k.term = term;
    }

    /// Real time since this node last applied (or restored) a stamp that moved ledger time
    /// forward, ns, by its monotonic clock; `None` before the first. The leader's ticker
    /// proposes a `Tick` only when this reaches its period: any entry that moved ledger time
    /// did what a tick would. Under a [`ManualNodeClock`](super::ManualNodeClock) it grows
    /// only as the test moves the monotonic clock, so a test that waits for an expiry must
    /// move it by at least a tick period.
    pub fn since_applied_ns(&self) -> Option<u64> {
        let now_ns = self.clock.monotonic_ns();
        self.known
            .lock()
            .recorded_ns
            .map(|t| now_ns.saturating_sub(t))
    }

    /// The stamp to put into an entry proposed now (see [`next_stamp`]).
    pub fn stamp(&self) -> u64 {
        let wall = self.clock.now_ms();
        let now_ns = self.clock.monotonic_ns();
        let k = *self.known.lock();
        next_stamp(wall, k.last_ms, k.anchor, now_ns)
    }

    /// Ledger time as this node can vouch for it now: its ceiling, never below the last applied
    /// stamp; `None` before it applied any stamp.
    pub fn now_ms(&self) -> Option<u64> {
        let now_ns = self.clock.monotonic_ns();
        let k = *self.known.lock();
        k.anchor.map(|a| a.ceiling_ms(now_ns).max(k.last_ms))
    }

    /// This node's wall clock minus [`LedgerTime::now_ms`], ms (positive: the wall clock is
    /// ahead), saturating at the `i64` range; `None` before any stamp was applied.
    pub fn skew_ms(&self) -> Option<i64> {
        let ledger = self.now_ms()?;
        Some(signed_diff(self.clock.now_ms(), ledger))
    }

    /// The last applied stamp, Unix ms (0 before the first).
    pub fn last_ms(&self) -> u64 {
        self.known.lock().last_ms
    }
}

/// `a − b` as i64, saturating.
fn signed_diff(a: u64, b: u64) -> i64 {
    if a >= b {
        i64::try_from(a - b).unwrap_or(i64::MAX)
    } else {
        i64::try_from(b - a).map_or(i64::MIN, |d| -d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::ManualNodeClock;

    const MS: u64 = NANOS_PER_MS;

    fn anchor(stamp_ms: u64, mono_ms: u64) -> Option<Anchor> {
        Some(Anchor {
            stamp_ms,
            mono_ns: mono_ms * MS,
        })
    }

    #[test]
    fn without_an_anchor_the_stamp_is_the_wall_clock_never_below_the_last_stamp() {
        assert_eq!(next_stamp(5_000, 0, None, 0), 5_000);
        assert_eq!(next_stamp(5_000, 7_000, None, 0), 7_000);
        assert_eq!(next_stamp(0, 0, None, u64::MAX), 0);
        assert_eq!(next_stamp(u64::MAX, 0, None, 0), u64::MAX);
    }

    #[test]
    fn a_wall_clock_ahead_is_held_to_the_real_time_elapsed_since_the_anchor() {
        // Applied 10_000 at monotonic 2 s; 300 ms later a wall 3 s ahead stamps 10_300.
        assert_eq!(
            next_stamp(13_300, 10_000, anchor(10_000, 2_000), 2_300 * MS),
            10_300
        );
        // A day ahead changes nothing.
        assert_eq!(
            next_stamp(
                10_000 + 86_400_000,
                10_000,
                anchor(10_000, 2_000),
                2_300 * MS
            ),
            10_300
        );
        // Sub-millisecond elapsed time rounds down.
        assert_eq!(
            next_stamp(u64::MAX, 10_000, anchor(10_000, 2_000), 2_000 * MS + MS - 1),
            10_000
        );
    }

    #[test]
    fn a_wall_clock_behind_slows_ledger_time_but_never_freezes_or_sends_it_back() {
        // Between the last stamp and the ceiling: the wall clock wins.
        assert_eq!(
            next_stamp(10_100, 10_000, anchor(10_000, 0), 300 * MS),
            10_100
        );
        // Behind the last stamp: ledger time runs at real rate from the anchor.
        assert_eq!(
            next_stamp(9_000, 10_000, anchor(10_000, 0), 300 * MS),
            10_300
        );
        assert_eq!(
            next_stamp(0, 10_000, anchor(10_000, 0), u64::MAX),
            10_000 + u64::MAX / MS
        );
        // No monotonic time elapsed: the last stamp.
        assert_eq!(next_stamp(0, 10_000, anchor(10_000, 0), 0), 10_000);
        assert_eq!(
            next_stamp(0, u64::MAX, anchor(u64::MAX, 0), u64::MAX),
            u64::MAX
        );
    }

    #[test]
    fn ledger_time_a_day_ahead_of_this_node_keeps_running_at_real_rate() {
        // A fresh cluster's first leader had no anchor and a clock a day ahead: its stamp is
        // the ledger's time now. A node with a correct clock must not freeze ledger time until
        // its own wall clock catches up a day later: it advances by what it measures.
        let day = 86_400_000;
        let clock = ManualNodeClock::with_monotonic(50_000, 0);
        let time = LedgerTime::new(Arc::new(clock.clone()));
        time.applied(50_000 + day);
        clock.advance(300);
        assert_eq!(time.stamp(), 50_000 + day + 300);
        time.applied(50_000 + day + 300);
        clock.advance(700);
        assert_eq!(time.stamp(), 50_000 + day + 1_000);
        assert_eq!(time.skew_ms(), Some(-86_400_000));
    }

    #[test]
    fn the_stamp_saturates_at_the_extremes() {
        assert_eq!(
            next_stamp(u64::MAX, 0, anchor(u64::MAX - 1, 0), u64::MAX),
            u64::MAX
        );
        assert_eq!(
            next_stamp(u64::MAX, u64::MAX, anchor(u64::MAX, 0), 0),
            u64::MAX
        );
        assert_eq!(next_stamp(u64::MAX, 0, anchor(0, 0), 0), 0);
        // A monotonic reading before the anchor's (impossible on one host) counts as no time.
        assert_eq!(next_stamp(u64::MAX, 5, anchor(5, u64::MAX / MS), 0), 5);
        assert_eq!(
            Anchor {
                stamp_ms: 0,
                mono_ns: 0
            }
            .ceiling_ms(u64::MAX),
            u64::MAX / MS
        );
    }

    #[test]
    fn a_new_term_replaces_the_anchor_so_a_lagging_leader_is_not_jumped_past() {
        // `allot-sim --seed 115`: a follower applied term 2's stamp 2_080 at monotonic 2.08 s.
        // The term-2 leader crashed and came back with its downtime uncounted, won term 4 and
        // stamped 3_554 (2.3 s behind real time), applied here at 5.86 s. Elected at 6.003 s,
        // this node must go on from 3_554 at real rate, not from the term-2 anchor (≈ 6_003:
        // a 2.4 s jump that expired live allocations at once).
        let clock = ManualNodeClock::with_monotonic(2_080, 2_080 * MS);
        let time = LedgerTime::new(Arc::new(clock.clone()));
        time.applied_in_term(2_080, 2);
        clock.advance(5_860 - 2_080);
        time.applied_in_term(3_554, 4);
        clock.advance(6_003 - 5_860);
        assert_eq!(time.stamp(), 3_554 + 143);
        // Within one term the most generous stamp still anchors (commit latency not lost).
        clock.advance(7);
        time.applied_in_term(3_554 + 143, 4);
        assert_eq!(time.stamp(), 3_554 + 150);
        // A restored or installed stamp starts afresh too.
        time.applied(3_800);
        clock.advance(10);
        assert_eq!(time.stamp(), 3_810);
    }

    #[test]
    fn the_next_anchor_merges_within_a_term_and_starts_afresh_across_terms() {
        let old = Anchor {
            stamp_ms: 1_000,
            mono_ns: 0,
        };
        let lagging = Anchor {
            stamp_ms: 1_000,
            mono_ns: 5_000 * MS,
        };
        assert_eq!(next_anchor(Some(old), Some(3), lagging, Some(3)), old);
        assert_eq!(next_anchor(Some(old), Some(3), lagging, Some(4)), lagging);
        assert_eq!(next_anchor(Some(old), None, lagging, Some(3)), lagging);
        assert_eq!(next_anchor(Some(old), Some(3), lagging, None), lagging);
        assert_eq!(next_anchor(None, None, lagging, Some(1)), lagging);
    }

    #[test]
    fn the_anchor_keeps_the_most_generous_stamp_so_commit_latency_never_accumulates() {
        let first = Anchor {
            stamp_ms: 1_000,
            mono_ns: 10 * MS,
        };
        // Stamped from that ceiling and applied 2 ms later: below the ceiling, the anchor stays.
        let later = Anchor {
            stamp_ms: 1_005,
            mono_ns: 17 * MS,
        };
        assert_eq!(merge_anchor(Some(first), later), first);
        // A stamp above the ceiling (another node's evidence) moves it; equal does not.
        let above = Anchor {
            stamp_ms: 1_010,
            mono_ns: 15 * MS,
        };
        assert_eq!(merge_anchor(Some(first), above), above);
        let equal = Anchor {
            stamp_ms: 1_005,
            mono_ns: 15 * MS,
        };
        assert_eq!(merge_anchor(Some(first), equal), first);
        assert_eq!(merge_anchor(None, later), later);
        // Extremes compare exactly, without overflow.
        let max = Anchor {
            stamp_ms: u64::MAX,
            mono_ns: 0,
        };
        let min = Anchor {
            stamp_ms: 0,
            mono_ns: u64::MAX,
        };
        assert_eq!(merge_anchor(Some(min), max), max);
        assert_eq!(merge_anchor(Some(max), min), max);
    }

    #[test]
    fn real_time_since_the_last_applied_stamp_is_measured_on_the_monotonic_clock() {
        let clock = ManualNodeClock::with_monotonic(50_000, 7 * MS);
        let time = LedgerTime::new(Arc::new(clock.clone()));
        assert_eq!(time.since_applied_ns(), None);
        // A stamp of 0 is no time at all: still nothing applied.
        time.applied(0);
        assert_eq!(time.since_applied_ns(), None);
        time.applied_in_term(50_000, 1);
        assert_eq!(time.since_applied_ns(), Some(0));
        // The wall clock does not count, the monotonic clock does.
        clock.advance_wall(10_000);
        assert_eq!(time.since_applied_ns(), Some(0));
        clock.advance_monotonic(250);
        assert_eq!(time.since_applied_ns(), Some(250 * MS));
        // A stamp that does not move ledger time (replayed, an earlier term's) restarts
        // nothing; one that moves it does.
        time.applied_in_term(40_000, 1);
        time.applied_in_term(50_000, 2);
        assert_eq!(time.since_applied_ns(), Some(250 * MS));
        assert_eq!(time.last_ms(), 50_000);
        time.applied_in_term(50_001, 2);
        assert_eq!(time.since_applied_ns(), Some(0));
    }

    #[test]
    fn a_node_stamps_from_what_it_applied_and_measures_its_skew() {
        let clock = ManualNodeClock::with_monotonic(50_000, 7 * MS);
        let time = LedgerTime::new(Arc::new(clock.clone()));
        assert_eq!(
            (time.stamp(), time.now_ms(), time.skew_ms()),
            (50_000, None, None)
        );
        // Nothing stamped yet: 0 anchors nothing.
        time.applied(0);
        assert_eq!(time.now_ms(), None);
        // Applies a stamp from a leader 1 s behind this node's wall.
        time.applied(49_000);
        assert_eq!((time.now_ms(), time.skew_ms()), (Some(49_000), Some(1_000)));
        clock.advance(250);
        assert_eq!(time.stamp(), 49_250);
        clock.set(0);
        assert_eq!((time.stamp(), time.skew_ms()), (49_250, Some(-49_250)));
        assert_eq!(time.last_ms(), 49_000);
        assert_eq!(signed_diff(u64::MAX, 0), i64::MAX);
        assert_eq!(signed_diff(0, u64::MAX), i64::MIN);
        assert_eq!(signed_diff(0, 1), -1);
    }
}
