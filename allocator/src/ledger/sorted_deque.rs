//! An ordered set of values that arrive (almost) in order, as one ring buffer (issue 13 item 3):
//! the time index of remembered answers, whose entries begin with the ledger time they were
//! remembered at, which never goes back.
//!
//! A `BTreeSet` fed in order splits every full node into a half-full one that is never filled
//! again: about 1.8 times the entries' size, plus a node header each. Here the entries are
//! contiguous, the oldest is removed from the front and a new one goes in at the back, or close
//! to it after a binary search.
//!
//! Same semantics as the `BTreeSet` it replaces for the operations the ledger uses (entries in
//! order, no duplicates) and the same serde form (a sequence in order), so snapshots written
//! before and after the change decode alike; a decoded sequence is sorted and deduplicated as
//! a `BTreeSet` would be.

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, Serializer};
use std::collections::VecDeque;

/// An ordered set kept as a sorted ring buffer (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortedDeque<T>(VecDeque<T>);

impl<T> Default for SortedDeque<T> {
    fn default() -> Self {
        SortedDeque(VecDeque::new())
    }
}

impl<T: Ord> SortedDeque<T> {
    /// Adds `x` in order; false (and nothing changes) when it is there already. O(log n) to
    /// find its place plus the entries after it moved: none for an entry at the back.
    pub fn insert(&mut self, x: T) -> bool {
        if self.0.back().is_none_or(|last| *last < x) {
            self.0.push_back(x);
            return true;
        }
        match self.0.binary_search(&x) {
            Ok(_) => false,
            Err(i) => {
                self.0.insert(i, x);
                true
            }
        }
    }

    /// The smallest entry.
    pub fn first(&self) -> Option<&T> {
        self.0.front()
    }

    /// Removes and returns the smallest entry.
    pub fn pop_first(&mut self) -> Option<T> {
        self.0.pop_front()
    }
}

impl<T> SortedDeque<T> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter()
    }
}

impl<T: Ord> FromIterator<T> for SortedDeque<T> {
    /// The set of the values, in order, without duplicates (as a `BTreeSet` collects them).
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        let mut v: Vec<T> = values.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        v.shrink_to_fit();
        SortedDeque(VecDeque::from(v))
    }
}

impl<T> IntoIterator for SortedDeque<T> {
    type Item = T;
    type IntoIter = std::collections::vec_deque::IntoIter<T>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<T: Serialize> Serialize for SortedDeque<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

impl<'de, T: Ord + Deserialize<'de>> Deserialize<'de> for SortedDeque<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // In order, no duplicates: what the ledger writes; anything else is put in order, as
        // the `BTreeSet` this replaces did.
        let v = Vec::<T>::deserialize(d)?;
        if v.windows(2).all(|w| w[0] < w[1]) {
            return Ok(SortedDeque(VecDeque::from(v)));
        }
        Ok(v.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn enc<T: Serialize>(v: &T) -> Vec<u8> {
        bincode::serde::encode_to_vec(v, bincode::config::standard()).expect("encodes")
    }

    fn dec<T: serde::de::DeserializeOwned>(b: &[u8]) -> T {
        bincode::serde::decode_from_slice(b, bincode::config::standard())
            .expect("decodes")
            .0
    }

    type Entry = (u64, String);

    /// Inserts `xs` into both and checks that they agree after each.
    fn both(xs: &[(u64, &str)]) -> (SortedDeque<Entry>, BTreeSet<Entry>) {
        let (mut d, mut b) = (SortedDeque::default(), BTreeSet::new());
        for (t, s) in xs {
            let x = (*t, s.to_string());
            assert_eq!(d.insert(x.clone()), b.insert(x));
            assert!(d.iter().eq(b.iter()));
            assert_eq!(d.first(), b.first());
            assert_eq!(d.len(), b.len());
        }
        (d, b)
    }

    #[test]
    fn it_behaves_as_a_btreeset_in_order_and_out_of_order() {
        let (mut d, mut b) = both(&[
            (5, "b"),
            (5, "a"),
            (7, "a"),
            (6, "z"),
            (5, "b"),
            (0, ""),
            (u64::MAX, "end"),
            (7, "a"),
        ]);
        while let Some(x) = b.pop_first() {
            assert_eq!(d.pop_first(), Some(x));
        }
        assert!(d.len() == 0 && d.pop_first().is_none() && d.first().is_none());
    }

    /// A window of recent entries, the oldest removed first as the ledger forgets answers:
    /// the ring's start moves around its buffer, and entries out of order or repeated land
    /// in the middle of a wrapped ring.
    #[test]
    fn it_stays_a_btreeset_as_the_ring_wraps_around() {
        let (mut d, mut b) = (SortedDeque::default(), BTreeSet::new());
        for t in 0..300u64 {
            let at = if t % 7 == 3 { t - 2 } else { t };
            let x: Entry = (at, format!("r{}", t % 5));
            assert_eq!(d.insert(x.clone()), b.insert(x.clone()));
            if t % 11 == 0 {
                assert!(!d.insert(x));
            }
            if d.len() > 6 {
                assert_eq!(d.pop_first(), b.pop_first());
            }
            assert!(d.iter().eq(b.iter()));
            assert_eq!(d.first(), b.first());
        }
    }

    #[test]
    fn it_encodes_as_the_btreeset_it_replaces_and_decodes_back() {
        let (d, b) = both(&[(3, "r2"), (1, "r1"), (3, "r1"), (9, "r9")]);
        assert_eq!(enc(&d), enc(&b));
        assert_eq!(dec::<SortedDeque<(u64, String)>>(&enc(&b)), d);
        let empty = SortedDeque::<(u64, String)>::default();
        assert_eq!(enc(&empty), enc(&BTreeSet::<(u64, String)>::new()));
        assert_eq!(dec::<SortedDeque<(u64, String)>>(&enc(&empty)), empty);
    }

    #[test]
    fn a_sequence_out_of_order_or_with_duplicates_decodes_as_a_btreeset_would() {
        let odd: Vec<(u64, String)> = vec![(4, "b".into()), (1, "a".into()), (4, "b".into())];
        let d: SortedDeque<(u64, String)> = dec(&enc(&odd));
        let b: BTreeSet<(u64, String)> = dec(&enc(&odd));
        assert!(d.iter().eq(b.iter()));
        assert_eq!(d.into_iter().count(), 2);
    }
}
