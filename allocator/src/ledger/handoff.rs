//! Versioned handoff of one policy key's regional parts (design §5).
//!
//! A region's part (parts per million of the key's rate and capacity) moves in two steps. A
//! lowered part applies to the region's new grants at once (its renewals come in a greater
//! epoch under the new, smaller part), but the difference stays *reserved* until every
//! allocation the region was granted under an older handoff version is released or expired:
//! only then is it free, and only free parts can be raised. Both operator changes
//! (`allotctl shares set`) and the automatic division by demand move parts this way, so no part
//! is ever granted twice.

use allot_common::config::PPM;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The smallest change of a part, ppm, made while every busy region has what it needs: smaller
/// moves wait (so parts do not flap with every measurement), larger ones go through the
/// handoff. 1/32 of the whole.
pub const HYSTERESIS_PPM: u32 = PPM / 32;

/// One region's part of one policy key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Part {
    /// What new grants may use now, ppm.
    pub(super) effective_ppm: u32,
    /// What is still held back for allocations granted under an older, larger part, ppm.
    pub(super) reserved_ppm: u32,
    /// Handoff version whose lowering created the reservation.
    pub(super) lowered_at: u64,
    /// Live allocations of this key and region by the handoff version they were granted under.
    pub(super) live_by_version: BTreeMap<u64, u64>,
    /// The part the last division settled on, ppm; above `effective_ppm` while a raise waits
    /// for other regions' older allocations to end.
    pub(super) desired_ppm: u32,
    /// When the part was last raised, Unix ms.
    pub(super) raised_at_ms: u64,
}

impl Part {
    /// What this part keeps from the others now: its effective part or its reservation.
    fn held(&self) -> u32 {
        self.effective_ppm.max(self.reserved_ppm)
    }

    /// Lowers the part to `to` for new grants; the old part stays reserved (see module docs).
    fn lower(&mut self, to: u32, version: u64) {
        self.reserved_ppm = self.reserved_ppm.max(self.effective_ppm);
        self.effective_ppm = to;
        self.lowered_at = version;
    }

    /// Drops the reservation once no allocation granted before the lowering is live.
    fn clear_if_done(&mut self) {
        if self.reserved_ppm > self.effective_ppm {
            let older_live = self
                .live_by_version
                .range(..self.lowered_at)
                .any(|(_, &n)| n > 0);
            if !older_live {
                self.reserved_ppm = 0;
            }
        } else {
            self.reserved_ppm = 0;
        }
    }
}

/// The regional parts of one policy key and the handoff version they move by.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Parts {
    /// Increases with every lowering; allocations record the version they were granted under.
    pub(super) version: u64,
    /// Per region.
    pub(super) by_region: BTreeMap<String, Part>,
}

impl Parts {
    /// The part new grants of `region` may use now, ppm (0 for a region without one).
    pub(super) fn effective(&self, region: &str) -> u32 {
        self.by_region.get(region).map_or(0, |p| p.effective_ppm)
    }

    /// The part `region` is being raised to while its raise waits for free space, ppm; 0 when
    /// no raise is pending.
    pub(super) fn pending_raise(&self, region: &str) -> u32 {
        self.by_region
            .get(region)
            .filter(|p| p.desired_ppm > p.effective_ppm)
            .map_or(0, |p| p.desired_ppm)
    }

    /// Counts a grant to `region` under the current version.
    pub(super) fn granted(&mut self, region: &str) {
        let v = self.version;
        let p = self.by_region.entry(region.to_string()).or_default();
        *p.live_by_version.entry(v).or_default() += 1;
    }

    /// Counts the end (release or expiry) of an allocation of `region` granted under `version`.
    pub(super) fn ended(&mut self, region: &str, version: u64) {
        if let Some(p) = self.by_region.get_mut(region) {
            if let Some(n) = p.live_by_version.get_mut(&version) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    p.live_by_version.remove(&version);
                }
            }
        }
    }

    /// Hysteresis: keeps the current part of every region whose desired change is below
    /// [`HYSTERESIS_PPM`] (and neither to nor from 0), so parts do not flap with every
    /// measurement. A region short of what it needs (`needs`: its guarantee capped by its
    /// demand) always moves to its desired part, and when the kept parts would then add up to
    /// more than the whole, every part above its desired one moves down to it exactly, so the
    /// short region gets its need within one handoff.
    ///
    /// A region whose lowering is still being handed off is not lowered again until that
    /// handoff completes: each lowering waits for the allocations granted before it, so lowering
    /// a busy region again and again would hold its reservation forever. While no region is
    /// short, a part raised less than `hold_ms` ago is not lowered either (except to 0): its
    /// holders' measured demand still shows what the smaller part allowed.
    pub(super) fn damp(
        &self,
        desired: &mut BTreeMap<String, u32>,
        needs: &BTreeMap<String, u32>,
        now_ms: u64,
        hold_ms: u64,
    ) {
        let pending = |r: &str| {
            self.by_region
                .get(r)
                .is_some_and(|p| p.reserved_ppm > p.effective_ppm)
        };
        let fresh = |r: &str| {
            self.by_region
                .get(r)
                .is_some_and(|p| p.raised_at_ms.saturating_add(hold_ms) > now_ms)
        };
        let any_short = needs.iter().any(|(r, &n)| self.effective(r) < n);
        let settling = |r: &str, d: u32| d != 0 && d < self.effective(r) && fresh(r) && !any_short;
        let mut kept: BTreeMap<String, u32> = desired
            .iter()
            .map(|(r, &d)| {
                let cur = self.effective(r);
                let short = needs.get(r).is_some_and(|&n| cur < n);
                let small = cur != 0 && d != 0 && cur.abs_diff(d) < HYSTERESIS_PPM;
                let hold = (small && !short) || (d < cur && pending(r)) || settling(r, d);
                (r.clone(), if hold { cur } else { d })
            })
            .collect();
        // Raises only grow into free space: when the kept parts add up to more than the whole,
        // every part kept above its desired one (unless handing off or settling) moves down to
        // it exactly, so the others' raises can complete.
        let total: u64 = kept.values().map(|&p| u64::from(p)).sum();
        if total > u64::from(PPM) {
            for (r, k) in kept.iter_mut() {
                let d = desired.get(r).copied().unwrap_or(0);
                if !pending(r) && !settling(r, d) {
                    *k = (*k).min(d);
                }
            }
        }
        *desired = kept;
    }

    /// Moves every region toward its `desired` part: lowerings first (one new version for all
    /// of them), then reservations whose older allocations ended are dropped, then raises grow
    /// into what is free, in region-name order (recording `now_ms` as their raise time). Σ held
    /// parts never exceeds [`PPM`].
    pub(super) fn hand_off(&mut self, desired: &BTreeMap<String, u32>, now_ms: u64) {
        let lowering = desired.iter().any(|(r, &d)| d < self.effective(r));
        if lowering {
            self.version = self.version.saturating_add(1);
        }
        for (r, &d) in desired {
            let p = self.by_region.entry(r.clone()).or_default();
            p.desired_ppm = d;
            if d < p.effective_ppm {
                p.lower(d, self.version);
            }
        }
        for p in self.by_region.values_mut() {
            p.clear_if_done();
        }
        for (r, &d) in desired {
            if d <= self.effective(r) {
                continue;
            }
            let others: u64 = self
                .by_region
                .iter()
                .filter(|(n, _)| *n != r)
                .map(|(_, p)| u64::from(p.held()))
                .sum();
            let free = u64::from(PPM).saturating_sub(others);
            let free = u32::try_from(free).unwrap_or(PPM);
            if let Some(p) = self.by_region.get_mut(r) {
                let raised = d.min(free).max(p.effective_ppm);
                if raised > p.effective_ppm {
                    p.effective_ppm = raised;
                    p.raised_at_ms = now_ms;
                }
            }
        }
        debug_assert!(self.held_total() <= u64::from(PPM));
    }

    /// Σ held parts, ppm.
    fn held_total(&self) -> u64 {
        self.by_region.values().map(|p| u64::from(p.held())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(r, p)| (r.to_string(), *p)).collect()
    }

    #[test]
    fn a_lowered_part_is_freed_only_when_its_older_allocations_end() {
        let mut p = Parts::default();
        p.hand_off(&want(&[("eu", 500_000), ("us", 500_000)]), 0);
        assert_eq!((p.effective("eu"), p.effective("us")), (500_000, 500_000));
        p.granted("us");
        let v_us = p.version;
        // us goes idle, eu wants everything: us is lowered at once, eu waits for us's grant.
        p.hand_off(&want(&[("eu", 1_000_000), ("us", 0)]), 0);
        assert_eq!((p.effective("eu"), p.effective("us")), (500_000, 0));
        assert!(p.version > v_us, "a lowering starts a new version");
        // A grant to us under the new version does not hold the handoff back.
        p.granted("us");
        p.ended("us", v_us);
        p.hand_off(&want(&[("eu", 1_000_000), ("us", 0)]), 0);
        assert_eq!((p.effective("eu"), p.effective("us")), (1_000_000, 0));
        assert!(p.held_total() <= u64::from(PPM));
    }

    #[test]
    fn small_changes_wait_unless_a_region_is_short() {
        let mut p = Parts::default();
        p.hand_off(&want(&[("eu", 600_000), ("us", 400_000)]), 0);
        let needs = want(&[("eu", 500_000), ("us", 300_000)]);
        let mut d = want(&[("eu", 590_000), ("us", 410_000)]);
        p.damp(&mut d, &needs, 0, 0);
        assert_eq!(d, want(&[("eu", 600_000), ("us", 400_000)]));
        // A change to 0 (idle) is never damped.
        let mut d = want(&[("eu", 1_000_000), ("us", 0)]);
        p.damp(&mut d, &needs, 0, 0);
        assert_eq!(d, want(&[("eu", 1_000_000), ("us", 0)]));
        // us needs 420 000 and has 400 000: it moves, and eu, kept at 600 000, would leave too
        // little, so eu moves down exactly too.
        let needs = want(&[("eu", 500_000), ("us", 420_000)]);
        let mut d = want(&[("eu", 580_000), ("us", 420_000)]);
        p.damp(&mut d, &needs, 0, 0);
        assert_eq!(d, want(&[("eu", 580_000), ("us", 420_000)]));
        p.hand_off(&d, 0);
        assert_eq!((p.effective("eu"), p.effective("us")), (580_000, 420_000));
        // A short region that fits beside the kept parts moves alone.
        let mut d = want(&[("eu", 570_000), ("us", 430_000)]);
        let needs = want(&[("eu", 500_000), ("us", 0)]);
        p.damp(&mut d, &needs, 0, 0);
        assert_eq!(d, want(&[("eu", 580_000), ("us", 420_000)]));
        // A part raised within the hold is not lowered while nobody is short; to 0 it is.
        let mut q = Parts::default();
        q.hand_off(&want(&[("eu", 500_000)]), 1_000);
        let none = want(&[("eu", 0)]);
        let mut d = want(&[("eu", 300_000)]);
        q.damp(&mut d, &none, 2_000, 2_700);
        assert_eq!(d, want(&[("eu", 500_000)]));
        let mut d = want(&[("eu", 300_000)]);
        q.damp(&mut d, &none, 3_700, 2_700);
        assert_eq!(d, want(&[("eu", 300_000)]));
        let mut d = want(&[("eu", 0)]);
        q.damp(&mut d, &none, 2_000, 2_700);
        assert_eq!(d, want(&[("eu", 0)]));
    }

    #[test]
    fn counters_saturate_and_unknown_regions_are_ignored() {
        let mut p = Parts::default();
        p.ended("nowhere", 7);
        p.granted("eu");
        p.ended("eu", 0);
        p.ended("eu", 0);
        assert!(p.by_region["eu"].live_by_version.is_empty());
        p.hand_off(&want(&[("eu", 10)]), 0);
        p.version = u64::MAX;
        p.hand_off(&want(&[("eu", 0)]), 0);
        assert_eq!((p.version, p.effective("eu")), (u64::MAX, 0));
        assert_eq!(p.by_region["eu"].lowered_at, u64::MAX);
    }
}
