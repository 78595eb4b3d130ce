//! A map of a few entries as one sorted vector: the per-key maps of the ledger (a key's
//! regions, a region's asking holders) hold one to a handful of entries, where a `BTreeMap`
//! allocates a whole node of eleven slots (about 2 KB for a key's one region; issue 13 item 3).
//!
//! Same semantics as the `BTreeMap` it replaces for the operations the ledger uses: entries in
//! key order, one value per key, and the same serde form (a map, in key order), so snapshots
//! written before and after the change decode alike. Lookups are binary searches; an insert of
//! a new key moves the entries after it (a key has at most `max_regions` regions and a region
//! `max_holders` holders, both capped). Capacity grows by one entry at a time: these maps are
//! small and rarely grow, and the spare slots of the usual doubling would cost what the change
//! saves.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde::ser::{Serialize, Serializer};
use std::borrow::Borrow;
use std::marker::PhantomData;

/// A small ordered map (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmallMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SmallMap<K, V> {
    fn default() -> Self {
        SmallMap(Vec::new())
    }
}

impl<K: Ord, V> SmallMap<K, V> {
    fn find<Q: Ord + ?Sized>(&self, k: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.0.binary_search_by(|(x, _)| x.borrow().cmp(k))
    }

    /// The value of `k`.
    pub fn get<Q: Ord + ?Sized>(&self, k: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.find(k).ok().map(|i| &self.0[i].1)
    }

    /// The value of `k`, mutably.
    pub fn get_mut<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.find(k).ok().map(|i| &mut self.0[i].1)
    }

    /// Whether `k` has a value.
    pub fn contains_key<Q: Ord + ?Sized>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.find(k).is_ok()
    }

    /// Sets the value of `k`; returns the one it replaces.
    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        match self.find(&k) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, v)),
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (k, v));
                None
            }
        }
    }

    /// Removes `k`; returns its value.
    pub fn remove<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let i = self.find(k).ok()?;
        let (_, v) = self.0.remove(i);
        self.0.shrink_to_fit();
        Some(v)
    }

    /// The value of `k`, inserted as `V::default()` when absent.
    pub fn entry_or_default(&mut self, k: K) -> &mut V
    where
        V: Default,
    {
        let i = match self.find(&k) {
            Ok(i) => i,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (k, V::default()));
                i
            }
        };
        &mut self.0[i].1
    }

    /// Replaces every key by `f` of it, which must order as the key it replaces (an equal
    /// key held elsewhere, to share it).
    pub fn replace_keys(&mut self, mut f: impl FnMut(&K) -> K) {
        for (k, _) in self.0.iter_mut() {
            let new = f(k);
            debug_assert!(new == *k, "a replaced key must equal the old one");
            *k = new;
        }
    }

    /// Keeps the entries for which `f` is true.
    pub fn retain(&mut self, mut f: impl FnMut(&K, &mut V) -> bool) {
        let before = self.0.len();
        self.0.retain_mut(|(k, v)| f(k, v));
        if self.0.len() < before {
            self.0.shrink_to_fit();
        }
    }
}

impl<K, V> SmallMap<K, V> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no entry.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The entries in key order, values mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.0.iter().map(|(k, _)| k)
    }

    /// The values in key order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }
}

impl<K: Ord + Borrow<Q>, V, Q: Ord + ?Sized> std::ops::Index<&Q> for SmallMap<K, V> {
    type Output = V;

    fn index(&self, k: &Q) -> &V {
        self.get(k).expect("no entry for the key")
    }
}

impl<'a, K, V> IntoIterator for &'a SmallMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<K: Serialize, V: Serialize> Serialize for SmallMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de, K: Ord + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for SmallMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MapVisitor<K, V>(PhantomData<(K, V)>);
        impl<'de, K: Ord + Deserialize<'de>, V: Deserialize<'de>> Visitor<'de> for MapVisitor<K, V> {
            type Value = SmallMap<K, V>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                // Exactly as many slots as entries (a size hint is not trusted beyond a few).
                let mut m = SmallMap(Vec::with_capacity(a.size_hint().unwrap_or(0).min(16)));
                while let Some((k, v)) = a.next_entry()? {
                    m.insert(k, v);
                }
                m.0.shrink_to_fit();
                Ok(m)
            }
        }
        d.deserialize_map(MapVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn both(ops: &[(&str, Option<u32>)]) -> (SmallMap<String, u32>, BTreeMap<String, u32>) {
        let (mut s, mut b) = (SmallMap::default(), BTreeMap::new());
        for (k, v) in ops {
            match v {
                Some(v) => assert_eq!(s.insert(k.to_string(), *v), b.insert(k.to_string(), *v)),
                None => assert_eq!(s.remove(*k), b.remove(*k)),
            }
        }
        (s, b)
    }

    #[test]
    fn it_behaves_as_a_btreemap() {
        let ops = [
            ("eu-west", Some(1)),
            ("ap-south", Some(2)),
            ("us-east", Some(3)),
            ("eu-west", Some(4)),
            ("nowhere", None),
            ("ap-south", None),
            ("af-south", Some(5)),
        ];
        let (mut s, mut b) = both(&ops);
        assert!(s.iter().eq(b.iter()));
        assert!(s.keys().eq(b.keys()) && s.values().eq(b.values()));
        assert_eq!(s.len(), b.len());
        assert_eq!(s.get("eu-west"), Some(&4));
        assert_eq!(s["us-east"], 3);
        assert!(s.contains_key("af-south") && !s.contains_key("ap-south"));
        *s.entry_or_default("zz".into()) += 7;
        *b.entry("zz".into()).or_default() += 7;
        *s.entry_or_default("eu-west".into()) += 1;
        *b.entry("eu-west".into()).or_default() += 1;
        s.retain(|k, v| k != "us-east" && *v > 0);
        b.retain(|k, v| k != "us-east" && *v > 0);
        for (_, v) in s.iter_mut() {
            *v += 1;
        }
        for (_, v) in b.iter_mut() {
            *v += 1;
        }
        assert!((&s).into_iter().eq(b.iter()));
    }

    #[test]
    fn it_encodes_as_the_btreemap_it_replaces_and_decodes_back() {
        let (s, b) = both(&[("b", Some(2)), ("a", Some(1)), ("c", Some(3))]);
        let cfg = bincode::config::standard();
        let sb = bincode::serde::encode_to_vec(&s, cfg).expect("encodes");
        assert_eq!(sb, bincode::serde::encode_to_vec(&b, cfg).expect("encodes"));
        let (back, _): (SmallMap<String, u32>, usize) =
            bincode::serde::decode_from_slice(&sb, cfg).expect("decodes");
        assert_eq!(back, s);
        let empty = SmallMap::<String, u32>::default();
        let eb = bincode::serde::encode_to_vec(&empty, cfg).expect("encodes");
        assert_eq!(
            eb,
            bincode::serde::encode_to_vec(BTreeMap::<String, u32>::new(), cfg).expect("encodes")
        );
    }

    #[test]
    fn it_holds_no_spare_slots() {
        let mut s = SmallMap::default();
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            s.insert(k.to_string(), i);
            assert_eq!(s.0.capacity(), i + 1);
        }
        s.retain(|k, _| k != "b");
        assert_eq!(s.0.capacity(), 2);
    }
}
