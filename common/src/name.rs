//! Names looked up on the decision path (domains, descriptor keys and values) and a byte
//! comparison that stays inline for the short strings they usually are.
//!
//! A lookup of a request's `&str` in a map keyed by [`Name`] goes through [`NameRef`], which
//! hashes exactly as the stored name does and compares with [`bytes_eq`]: no call into the C
//! library's `memcmp` for a five-byte domain, several of which every decision makes.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};

/// Whether `a` and `b` hold the same bytes. Lengths up to 16 compare with at most two pairs of
/// (possibly overlapping) word loads; longer ones fall back to the slice comparison.
#[inline]
pub fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        0 => true,
        1..=3 => {
            // First, middle and last byte cover every position of 1 to 3 bytes.
            a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1]
        }
        4..=7 => word4(a, 0) == word4(b, 0) && word4(a, n - 4) == word4(b, n - 4),
        8..=16 => word8(a, 0) == word8(b, 0) && word8(a, n - 8) == word8(b, n - 8),
        _ => a == b,
    }
}

#[inline]
fn word4(s: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&s[at..at + 4]);
    u32::from_ne_bytes(w)
}

#[inline]
fn word8(s: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&s[at..at + 8]);
    u64::from_ne_bytes(w)
}

/// A map keyed by [`Name`], looked up with [`NameRef`] (foldhash: fast, randomly seeded).
pub type NameMap<V> = hashbrown::HashMap<Name, V, foldhash::fast::RandomState>;

/// Most entries a [`NameIndex`] scans linearly before it also keeps a hash index.
pub const LINEAR_MAX: usize = 8;

/// Values by [`Name`], for the small, read-mostly sets the decision path looks names up in
/// (domains, a descriptor node's keys, a key's values). Up to [`LINEAR_MAX`] entries a lookup
/// compares lengths and bytes inline (cheaper than hashing); above that a hash index is kept too.
/// Entries keep insertion order.
#[derive(Debug, Clone)]
pub struct NameIndex<V> {
    entries: Vec<(Name, V)>,
    index: Option<NameMap<usize>>,
}

impl<V> Default for NameIndex<V> {
    fn default() -> Self {
        NameIndex {
            entries: Vec::new(),
            index: None,
        }
    }
}

impl<V> NameIndex<V> {
    /// The value of `name`.
    #[inline]
    pub fn get(&self, name: &str) -> Option<&V> {
        match &self.index {
            Some(index) => index.get(&NameRef(name)).map(|&i| &self.entries[i].1),
            None => self
                .entries
                .iter()
                .find(|(n, _)| bytes_eq(n.as_str().as_bytes(), name.as_bytes()))
                .map(|(_, v)| v),
        }
    }

    /// The value of `name`, inserting `make()` first when absent.
    pub fn get_or_insert_with(&mut self, name: &str, make: impl FnOnce() -> V) -> &mut V {
        let found = match &self.index {
            Some(index) => index.get(&NameRef(name)).copied(),
            None => self.entries.iter().position(|(n, _)| n.as_str() == name),
        };
        let i = match found {
            Some(i) => i,
            None => {
                self.entries.push((Name::from(name), make()));
                let i = self.entries.len() - 1;
                if let Some(index) = &mut self.index {
                    index.insert(Name::from(name), i);
                } else if self.entries.len() > LINEAR_MAX {
                    self.index = Some(
                        self.entries
                            .iter()
                            .enumerate()
                            .map(|(i, (n, _))| (n.clone(), i))
                            .collect(),
                    );
                }
                i
            }
        };
        &mut self.entries[i].1
    }

    /// Sets the value of `name`; returns the one it replaces.
    pub fn insert(&mut self, name: &str, value: V) -> Option<V> {
        let mut value = Some(value);
        let slot = self.get_or_insert_with(name, || value.take().expect("taken once"));
        value.map(|v| std::mem::replace(slot, v))
    }

    /// Every value, in insertion order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }

    /// Number of names.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no name.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// An owned name used as a map key; hashes as `str` does.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Name(Box<str>);

impl Name {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Self {
        Name(s.into())
    }
}

impl From<String> for Name {
    fn from(s: String) -> Self {
        Name(s.into_boxed_str())
    }
}

impl Hash for Name {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h)
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A borrowed query for a map keyed by [`Name`]: same hash, inline comparison.
#[derive(Debug, Clone, Copy)]
pub struct NameRef<'a>(pub &'a str);

impl Hash for NameRef<'_> {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h)
    }
}

impl hashbrown::Equivalent<Name> for NameRef<'_> {
    #[inline]
    fn equivalent(&self, key: &Name) -> bool {
        bytes_eq(self.0.as_bytes(), key.0.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bytes_eq_agrees_with_slice_equality(a in proptest::collection::vec(0u8..4, 0..40),
                                               b in proptest::collection::vec(0u8..4, 0..40)) {
            prop_assert_eq!(bytes_eq(&a, &b), a == b);
            prop_assert!(bytes_eq(&a, &a));
        }

        #[test]
        fn bytes_eq_finds_any_single_difference(a in proptest::collection::vec(any::<u8>(), 1..40),
                                                 at in any::<prop::sample::Index>(),
                                                 flip in 1u8..=255) {
            let mut b = a.clone();
            let i = at.index(a.len());
            b[i] ^= flip;
            prop_assert!(!bytes_eq(&a, &b));
        }
    }

    #[test]
    fn name_index_finds_every_name_below_and_above_the_linear_limit() {
        let mut ix: NameIndex<usize> = NameIndex::default();
        let names: Vec<String> = (0..3 * LINEAR_MAX).map(|i| format!("n{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            *ix.get_or_insert_with(n, || i) += 0;
            assert_eq!(ix.len(), i + 1);
            for (j, m) in names.iter().enumerate().take(i + 1) {
                assert_eq!(ix.get(m), Some(&j));
            }
            assert_eq!(ix.get("absent"), None);
        }
        // Inserting an existing name keeps its value; `insert` replaces it.
        assert_eq!(*ix.get_or_insert_with("n0", || 99), 0);
        assert_eq!(ix.insert("n1", 1), Some(1));
        assert_eq!(ix.insert("new", 3 * LINEAR_MAX), None);
        assert_eq!(ix.get("new"), Some(&(3 * LINEAR_MAX)));
        assert_eq!(ix.len(), 3 * LINEAR_MAX + 1);
        ix.insert("new", 0);
        assert_eq!(
            ix.values().copied().collect::<Vec<_>>(),
            (0..3 * LINEAR_MAX).chain([0]).collect::<Vec<_>>()
        );
    }

    #[test]
    fn name_ref_finds_the_stored_name() {
        let mut m: hashbrown::HashMap<Name, u32, foldhash::fast::RandomState> = Default::default();
        m.insert(Name::from("search"), 1);
        m.insert(Name::from("a-much-longer-domain-name"), 2);
        assert_eq!(m.get(&NameRef("search")), Some(&1));
        assert_eq!(m.get(&NameRef("a-much-longer-domain-name")), Some(&2));
        assert_eq!(m.get(&NameRef("searcH")), None);
        assert_eq!(m.get(&NameRef("")), None);
    }
}
