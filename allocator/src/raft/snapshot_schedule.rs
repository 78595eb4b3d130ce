//! When a node builds its snapshot (log compaction): after `every` entries, as openraft's
//! `SnapshotPolicy::LogsSinceLast`, but each voter at its own turns in the log's index space,
//! so that the voters of a cluster build at different indexes instead of all at once.
//!
//! Every node applies the same entries, so with a plain count all of them cross the threshold
//! at the same index and encode the whole ledger at the same moment. The leader and the
//! follower whose acknowledgement completes the quorum then both work on a snapshot while
//! commits wait on them (on the benchmark's shared two cores, three encoders at once). In turns,
//! a third of the interval apart in a cluster of three, normally one voter builds at a time and
//! the other two, a quorum, commit as usual (measured in `docs/benchmarks.md`, "voters build
//! their snapshots in turn").
//!
//! The turns: with the voters sorted by id and `w = ⌈every / m⌉` for `m` voters, voter `k`'s
//! turns come when the count of applied entries reaches `k · w + n · m · w` (n = 0, 1, …): each
//! voter's turns are one cycle of `m · w ≥ every` entries apart, and the voters' turns `w`
//! apart. A voter builds when one of its turns came at least `w` entries after its last
//! snapshot (a snapshot installed from the leader just before a turn waits for the next one,
//! rather than landing near another voter's), or when `2 · every` entries were applied since,
//! whatever the turn (so a voter whose turns keep being skipped still compacts). Learners and a
//! single voter build after `every` entries, as before.
//!
//! The turns separate the voters' builds by log index, not by time: a build that takes longer
//! than `w` entries' worth of commits still overlaps the next voter's.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::app::App;
use super::types::typ::Raft;
use super::types::NodeId;

/// How long a trigger that produced no new snapshot waits before it is repeated: openraft
/// ignores a trigger while another build runs (one it started to answer a snapshot request,
/// say). A build that fails stops Raft with a fatal error, and this task with it.
const RETRY: Duration = Duration::from_secs(5);

/// A voter's slot: its position among the `voters` sorted ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    position: u64,
    voters: u64,
}

impl Slot {
    /// `id`'s slot among `voters`; `None` when it is not a voter or the only one (then it
    /// builds as soon as `every` entries were applied).
    pub(crate) fn of(id: NodeId, voters: impl IntoIterator<Item = NodeId>) -> Option<Slot> {
        let mut ids: Vec<NodeId> = voters.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        let position = ids.iter().position(|&v| v == id)?;
        (ids.len() > 1).then_some(Slot {
            position: position as u64,
            voters: ids.len() as u64,
        })
    }

    /// Entries between two voters' turns when snapshots come every `every` entries.
    fn width(&self, every: u64) -> u64 {
        every.div_ceil(self.voters).max(1)
    }

    /// How many of this voter's turns have come when `count` entries were applied.
    fn turns(&self, count: u64, every: u64) -> u64 {
        let width = self.width(every);
        let first = self.position.saturating_mul(width);
        match count.checked_sub(first) {
            None => 0,
            Some(after) => (after / width.saturating_mul(self.voters)).saturating_add(1),
        }
    }
}

/// Whether a node should build a snapshot now. `applied` and `snapshot` count the entries
/// applied and those its last snapshot covers (openraft's next indexes; 0 when none); `every`
/// is the entries between snapshots (≥ 1).
pub(crate) fn build_due(applied: u64, snapshot: u64, every: u64, slot: Option<Slot>) -> bool {
    let since = applied.saturating_sub(snapshot);
    match slot {
        None => since >= every,
        Some(s) => {
            // A turn in (snapshot + w − 1, applied]: at least w entries after the snapshot.
            let after = snapshot.saturating_add(s.width(every) - 1);
            since >= every.saturating_mul(2) || s.turns(applied, every) > s.turns(after, every)
        }
    }
}

/// Index after `log_id` (0 for none).
fn next_index(log_id: Option<&openraft::LogId<NodeId>>) -> u64 {
    log_id.map_or(0, |l| l.index.saturating_add(1))
}

/// Watches `raft`'s metrics and triggers its snapshots by [`build_due`] (the Raft config must
/// say `SnapshotPolicy::Never`). Ends when Raft stops.
pub(crate) fn spawn<A: App>(raft: Raft<A>, id: NodeId, every: u64) -> JoinHandle<()> {
    let every = every.max(1);
    tokio::spawn(async move {
        let mut metrics = raft.metrics();
        // The snapshot a trigger was sent for, and when: one trigger per snapshot reached.
        let mut sent: Option<(u64, Instant)> = None;
        // This node's slot and the membership (by its log id) it was computed from: the
        // metrics are published on every pass of openraft's loop, membership rarely changes.
        let mut slot_of: Option<(Option<openraft::LogId<NodeId>>, Option<Slot>)> = None;
        loop {
            let due = {
                let m = metrics.borrow_and_update();
                let membership = *m.membership_config.log_id();
                let slot = match slot_of {
                    Some((at, slot)) if at == membership => slot,
                    _ => {
                        let slot = Slot::of(id, m.membership_config.membership().voter_ids());
                        slot_of = Some((membership, slot));
                        slot
                    }
                };
                let snapshot = next_index(m.snapshot.as_ref());
                build_due(next_index(m.last_applied.as_ref()), snapshot, every, slot)
                    .then_some(snapshot)
            };
            if let Some(snapshot) = due {
                let repeat = sent.is_none_or(|(s, at)| s != snapshot || at.elapsed() >= RETRY);
                if repeat {
                    if raft.trigger().snapshot().await.is_err() {
                        return;
                    }
                    sent = Some((snapshot, Instant::now()));
                }
            }
            if metrics.changed().await.is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_the_position_among_sorted_voters_and_none_for_a_learner_or_a_lone_voter() {
        assert_eq!(
            Slot::of(3, [3, 1, 2]),
            Some(Slot {
                position: 2,
                voters: 3
            })
        );
        assert_eq!(Slot::of(4, [1, 2, 3]), None);
        assert_eq!(Slot::of(1, [1]), None);
        assert_eq!(Slot::of(1, [1, 1]), None);
    }

    #[test]
    fn below_every_entries_nothing_is_due_and_a_lone_node_builds_at_every() {
        assert!(!build_due(4_999, 0, 5_000, None));
        assert!(build_due(5_000, 0, 5_000, None));
        assert!(!build_due(9_999, 5_000, 5_000, None));
        assert!(build_due(10_000, 5_000, 5_000, None));
    }

    /// Plays a 3-voter cluster applying one entry at a time: every voter builds once per cycle,
    /// the voters' builds are a third of the threshold apart, and no log grows past `every`
    /// plus one entry per voter.
    #[test]
    fn three_voters_build_in_turn_a_third_of_the_threshold_apart() {
        let every = 5_000;
        let slots: Vec<Slot> = (1..=3).map(|id| Slot::of(id, [1, 2, 3]).unwrap()).collect();
        let mut last = [0u64; 3];
        let mut builds: Vec<(u64, usize)> = Vec::new();
        for applied in 1..=60_000u64 {
            for (v, slot) in slots.iter().enumerate() {
                if build_due(applied, last[v], every, Some(*slot)) {
                    assert!(applied - last[v] <= every + 2, "voter {v} at {applied}");
                    last[v] = applied;
                    builds.push((applied, v));
                }
            }
        }
        for v in 0..3 {
            let n = builds.iter().filter(|b| b.1 == v).count();
            assert!((11..=12).contains(&n), "voter {v} built {n} times");
        }
        for pair in builds.windows(2) {
            assert_ne!(pair[0].1, pair[1].1, "{pair:?}");
            assert_eq!(pair[1].0 - pair[0].0, 1_667, "{pair:?}");
        }
    }

    /// A node whose last snapshot is not at its turn (installed from the leader, or built
    /// before a restart) builds at its next turn at least a slot's width after that snapshot,
    /// or after `2 · every` entries when that comes first; the arithmetic saturates at the
    /// extremes.
    #[test]
    fn an_off_turn_snapshot_waits_for_a_turn_a_width_later_and_extremes_do_not_overflow() {
        let slot = Slot::of(2, [1, 2, 3]);
        // Voter 2's turns: 1_667, 6_668, 11_669 …
        assert!(build_due(1_667, 0, 5_000, slot));
        assert!(!build_due(1_666, 0, 5_000, slot));
        assert!(!build_due(6_667, 1_700, 5_000, slot));
        assert!(build_due(6_668, 1_700, 5_000, slot));
        // A snapshot installed at 6_000 is 668 entries before the turn at 6_668: that turn is
        // skipped (it would build next to voter 3's at 8_335), the one at 11_669 is taken.
        for applied in 6_000..11_669 {
            assert!(!build_due(applied, 6_000, 5_000, slot), "at {applied}");
        }
        assert!(build_due(11_669, 6_000, 5_000, slot));
        // At the turn's own index, a width before it or a width after: taken.
        assert!(build_due(6_668, 5_001, 5_000, slot));
        assert!(!build_due(6_668, 5_002, 5_000, slot));
        // With fewer entries per snapshot than voters, a cycle of turns is longer than twice
        // the threshold: voter 1's turns at 0, 3, 6 …, the log is compacted at 2 anyway.
        let first = Slot::of(1, [1, 2, 3]);
        assert!(!build_due(1, 0, 1, first));
        assert!(build_due(2, 0, 1, first));
        assert!(build_due(u64::MAX, 0, u64::MAX, slot));
        assert!(build_due(u64::MAX - 1, 0, u64::MAX, slot));
        assert!(!build_due(u64::MAX - 1, 0, u64::MAX, first));
    }
}
