//! Shared names and key bytes (issue 13 item 3): a rule id, a region, a holder or a canonical
//! key is held once, behind an `Arc`, and every table that names it holds a pointer to that one
//! copy instead of a string of its own (a key with one allocation named its rule id, key,
//! region and holder in five to seven tables).
//!
//! The serde form is the plain string (or byte sequence) each replaces, so snapshots and log
//! entries encode byte for byte as before (tested). Sharing is memory layout only: a name
//! compares, orders and hashes as its string.

use super::{KeyId, KeyState, Ledger};
use imbl::OrdMap;
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// A string shared between the tables that name it (see the module docs); serialized as the
/// string itself (serde's `rc` impls, `transparent`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Name(Arc<str>);

impl Name {
    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Self {
        Name(Arc::from(s))
    }
}

impl From<String> for Name {
    fn from(s: String) -> Self {
        Name(Arc::from(s))
    }
}

impl From<&Name> for String {
    fn from(n: &Name) -> Self {
        n.0.to_string()
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

/// A policy key's canonical bytes, shared like a [`Name`]; encoded as the `Vec<u8>` it
/// replaces (a sequence of bytes: serde serializes `[u8]` as `Vec<u8>` does).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KeyBytes(Arc<[u8]>);

impl Default for KeyBytes {
    fn default() -> Self {
        KeyBytes(Arc::from(&[][..]))
    }
}

impl Deref for KeyBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for KeyBytes {
    fn from(v: Vec<u8>) -> Self {
        KeyBytes(Arc::from(v))
    }
}

impl From<&[u8]> for KeyBytes {
    fn from(v: &[u8]) -> Self {
        KeyBytes(Arc::from(v))
    }
}

impl From<&str> for KeyBytes {
    fn from(s: &str) -> Self {
        KeyBytes(Arc::from(s.as_bytes()))
    }
}

impl fmt::Debug for KeyBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The names in use, so a name seen again is shared rather than copied. Names no table holds
/// any more are dropped when the set has doubled since it was last pruned, so it stays within
/// twice the names in use at O(1) amortised cost. Node-local: what is shared never changes a
/// value, so replicas that share differently still hold equal states.
#[derive(Debug, Clone, Default)]
pub struct Names {
    set: HashSet<Name>,
    prune_at: usize,
}

/// Fewest names kept before pruning is considered.
const MIN_PRUNE_AT: usize = 64;

impl Names {
    /// The shared name of `s`, added when new.
    pub fn intern(&mut self, s: &str) -> Name {
        if let Some(n) = self.set.get(s) {
            return n.clone();
        }
        let n = Name::from(s);
        if self.set.len() >= self.prune_at.max(MIN_PRUNE_AT) {
            // Only the set holds them: no table names them any more.
            self.set.retain(|x| Arc::strong_count(&x.0) > 1);
            self.prune_at = self.set.len().saturating_mul(2);
        }
        self.set.insert(n.clone());
        n
    }

    /// Names held now (in use or not yet pruned).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.set.len()
    }
}

impl Name {
    /// Whether `self` and `other` are one shared copy (not merely equal).
    #[cfg(test)]
    pub fn is_shared_with(&self, other: &Name) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// `kid` as the key table holds it (its shared rule id and bytes), else with its rule id
/// interned.
fn shared_kid(keys: &OrdMap<KeyId, Box<KeyState>>, names: &mut Names, kid: KeyId) -> KeyId {
    match keys.get_key_value(&kid) {
        Some((k, _)) => k.clone(),
        None => (names.intern(&kid.0), kid.1),
    }
}

impl Ledger {
    /// Shares the names of a ledger decoded from a snapshot, where every decoded string is a
    /// copy of its own: afterwards each table names a rule id, region, holder and key through
    /// one copy, as in a ledger that applied its commands itself. Memory layout only: no value
    /// changes.
    pub(super) fn share_names(&mut self) {
        let names = &mut self.names;
        let keys = std::mem::take(&mut self.keys);
        self.keys = keys
            .into_iter()
            .map(|((rule, key), mut ks)| {
                ks.regions.replace_keys(|r| names.intern(r));
                for (_, r) in ks.regions.iter_mut() {
                    let rated = std::mem::take(&mut r.rated);
                    r.rated = rated
                        .into_iter()
                        .map(|(h, id)| (names.intern(&h), id))
                        .collect();
                }
                ((names.intern(&rule), key), ks)
            })
            .collect();
        let allocations = std::mem::take(&mut self.allocations);
        self.allocations = allocations
            .into_iter()
            .map(|(id, mut a)| {
                let kid = shared_kid(&self.keys, names, (a.rule_id.clone(), a.key.clone()));
                (a.rule_id, a.key) = kid;
                a.region = names.intern(&a.region);
                a.holder = names.intern(&a.holder);
                (id, a)
            })
            .collect();
        let demands = std::mem::take(&mut self.demands);
        self.demands = demands
            .into_iter()
            .map(|((kid, region), mut asks)| {
                asks.replace_keys(|h| names.intern(h));
                let kid = shared_kid(&self.keys, names, kid);
                ((kid, names.intern(&region)), asks)
            })
            .collect();
        self.share_request_names();
    }

    /// [`Ledger::share_names`] for the remembered answers: the holder interned, and the
    /// (holder, request id) of the time index shared with the answer's.
    fn share_request_names(&mut self) {
        let names = &mut self.names;
        let requests = std::mem::take(&mut self.requests);
        self.requests = requests
            .into_iter()
            .map(|((h, id), v)| ((names.intern(&h), id), v))
            .collect();
        let times = std::mem::take(&mut self.request_times);
        self.request_times = times
            .into_iter()
            .map(|(at, h, id)| {
                let k = (h, id);
                match self.requests.get_key_value(&k) {
                    Some(((h, id), _)) => (at, h.clone(), id.clone()),
                    None => (at, names.intern(&k.0), k.1),
                }
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;
    use std::collections::BTreeSet;

    fn enc<T: Serialize>(v: &T) -> Vec<u8> {
        bincode::serde::encode_to_vec(v, bincode::config::standard()).expect("encodes")
    }

    /// `new` encodes as `old`, and `old`'s bytes decode to `new`.
    fn same_encoding<O: Serialize, N: Serialize + DeserializeOwned + PartialEq + fmt::Debug>(
        old: &O,
        new: &N,
    ) {
        assert_eq!(enc(new), enc(old));
        let (back, _): (N, usize) =
            bincode::serde::decode_from_slice(&enc(old), bincode::config::standard())
                .expect("decodes");
        assert_eq!(back, *new);
    }

    #[test]
    fn names_and_key_bytes_encode_as_the_strings_and_vectors_they_replace() {
        same_encoding(&String::from("eu-west"), &Name::from("eu-west"));
        let v: Vec<u8> = b"api\0tenant\0acme".to_vec();
        same_encoding(&v, &KeyBytes::from(v.clone()));
        // Tuples and sets of them too, as the ledger's tables hold them.
        let old: BTreeSet<(u64, String, String)> = [(5, "gw".into(), "r1".into())].into();
        let new: BTreeSet<(u64, Name, Name)> = [(5, "gw".into(), "r1".into())].into();
        same_encoding(&old, &new);
    }

    #[test]
    fn names_order_as_their_strings() {
        let mut words = ["b", "a", "ab", "", "B"];
        let mut names: Vec<Name> = words.iter().map(|w| Name::from(*w)).collect();
        words.sort();
        names.sort();
        assert!(names.iter().map(Name::as_str).eq(words));
        let mut keys: Vec<KeyBytes> = ["b", "a", "ab"].map(KeyBytes::from).into();
        keys.sort();
        assert_eq!(&*keys[1], b"ab");
    }

    #[test]
    fn an_interned_name_is_shared_and_an_unused_one_is_pruned() {
        let mut names = Names::default();
        let a = names.intern("holder-a");
        let b = names.intern("holder-a");
        assert!(Arc::ptr_eq(&a.0, &b.0));
        for i in 0..MIN_PRUNE_AT - 1 {
            names.intern(&format!("gone-{i}"));
        }
        // The set reached its bound: the next new name prunes every name no one holds.
        names.intern("holder-b");
        assert_eq!(names.len(), 2);
        assert!(Arc::ptr_eq(&names.intern("holder-a").0, &a.0));
    }
}
