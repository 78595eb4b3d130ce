//! Decoding of the ledger's persistent tables (imbl's `OrdMap` and `OrdSet`, see
//! [`super::Ledger`]) through the std collections they replaced.
//!
//! imbl's own `Deserialize` first reserves a vector as long as the length the bytes claim, and
//! bincode's serde path passes that length on unchecked: a damaged snapshot file or a forged
//! `InstallSnapshot` would then abort the process on an allocation of terabytes instead of
//! being refused. `BTreeMap` and `BTreeSet` reserve nothing and read entry by entry, so a
//! false length ends in a decode error at the end of the bytes (tested in `ledger_app`). The
//! encoded form is the same either way: a map, or a sequence, in order.

use imbl::{OrdMap, OrdSet};
use serde::{Deserialize, Deserializer};
use std::collections::{BTreeMap, BTreeSet};

/// Decodes an `OrdMap` written as a map, as a `BTreeMap` would be read (a repeated key keeps
/// its last value).
///
/// # Errors
/// The deserializer's, for bytes that are not such a map.
pub(super) fn map<'de, D, K, V>(d: D) -> Result<OrdMap<K, V>, D::Error>
where
    D: Deserializer<'de>,
    K: Ord + Clone + Deserialize<'de>,
    V: Clone + Deserialize<'de>,
{
    Ok(BTreeMap::<K, V>::deserialize(d)?.into_iter().collect())
}

/// Decodes an `OrdSet` written as a sequence, as a `BTreeSet` would be read (in order, without
/// duplicates).
///
/// # Errors
/// The deserializer's, for bytes that are not such a sequence.
pub(super) fn set<'de, D, T>(d: D) -> Result<OrdSet<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Ord + Clone + Deserialize<'de>,
{
    Ok(BTreeSet::<T>::deserialize(d)?.into_iter().collect())
}
