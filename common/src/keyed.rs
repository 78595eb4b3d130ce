//! Per-key state of one rule: a sharded hash table of slots with a cap on distinct keys and
//! eviction of idle state (design §10 "Keys": memory stays bounded however random the keys are).
//!
//! Concurrency: a lookup takes one shard's read lock, either just long enough to clone the slot's
//! `Arc` or, on the one-descriptor path ([`KeyTable::with_slot`]), for the decision itself; the
//! decision holds that one slot's mutex, so concurrent decisions on one key serialise
//! (no token is spent twice) while different keys never contend. There is no global lock. A slot
//! removed by eviction is marked `evicted` under its mutex, and a decision that finds that mark
//! looks the key up again, so it never spends on an orphaned slot.

use crate::algorithm::{LimitParams, LimitState};
use crate::descriptor::{encode_key, hash_entries, key_matches, Entry};
use crate::units::{Nanos, NANOS_PER_SEC};
use hashbrown::HashTable;
use parking_lot::{Mutex, RwLock};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SHARDS: usize = 16;

/// Shortest time between two eviction sweeps of a full table that found nothing idle: bounds the
/// work a flood of new keys can cause once every slot is in use.
pub const SWEEP_BACKOFF_NS: Nanos = NANOS_PER_SEC;

type Shard<V> = RwLock<HashTable<Arc<Keyed<V>>>>;

/// One key of a [`ShardedTable`] and its value.
#[derive(Debug)]
pub struct Keyed<V> {
    key: Box<[u8]>,
    hash: u64,
    /// The key's value.
    pub value: V,
}

impl<V> Keyed<V> {
    /// The canonical key (see [`crate::descriptor::encode_key`]).
    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

/// A concurrent map from descriptor entries to values, looked up without building the key:
/// 16 shards, each a read-write-locked hash table, with a per-table random hash seed.
/// Lookups hold a shard's read lock while cloning the value's `Arc`, or while a closure given the
/// value runs ([`try_with`](Self::try_with)).
pub struct ShardedTable<V> {
    shards: Box<[Shard<V>]>,
    hasher: foldhash::quality::RandomState,
    len: AtomicU64,
}

impl<V> Default for ShardedTable<V> {
    fn default() -> Self {
        ShardedTable {
            shards: (0..SHARDS).map(|_| RwLock::new(HashTable::new())).collect(),
            hasher: foldhash::quality::RandomState::default(),
            len: AtomicU64::new(0),
        }
    }
}

impl<V> std::fmt::Debug for ShardedTable<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedTable")
            .field("len", &self.len())
            .finish()
    }
}

impl<V> ShardedTable<V> {
    /// Number of keys held.
    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash of a key's entries under this table's seed.
    #[inline]
    pub fn hash(&self, entries: &[Entry<'_>]) -> u64 {
        let mut h = self.hasher.build_hasher();
        hash_entries(entries, &mut h);
        std::hash::Hasher::finish(&h)
    }

    #[inline]
    fn shard(&self, hash: u64) -> &Shard<V> {
        &self.shards[(hash >> 60) as usize % SHARDS]
    }

    /// The value of `entries` (whose [`hash`](Self::hash) is `hash`), if present.
    #[inline]
    pub fn get(&self, entries: &[Entry<'_>], hash: u64) -> Option<Arc<Keyed<V>>> {
        let eq = |s: &Arc<Keyed<V>>| s.hash == hash && key_matches(entries, &s.key);
        self.shard(hash).read().find(hash, eq).cloned()
    }

    /// Calls `f` with the value of `entries` (whose [`hash`](Self::hash) is `hash`) while its
    /// shard's read lock is held, so no reference count is touched; gives `f` back when absent.
    /// `f` must not take this table's locks (a writer waiting on the shard would deadlock it).
    #[inline]
    pub fn try_with<R, F: FnOnce(&Arc<Keyed<V>>) -> R>(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        f: F,
    ) -> Result<R, F> {
        let eq = |s: &Arc<Keyed<V>>| s.hash == hash && key_matches(entries, &s.key);
        let shard = self.shard(hash).read();
        match shard.find(hash, eq) {
            Some(v) => Ok(f(v)),
            None => Err(f),
        }
    }

    /// As [`try_with`](Self::try_with), inserting `make()` first when the key is absent.
    #[inline]
    pub fn with_or_insert<R>(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        make: impl FnOnce() -> V,
        f: impl FnOnce(&Arc<Keyed<V>>) -> R,
    ) -> R {
        match self.try_with(entries, hash, f) {
            Ok(r) => r,
            Err(f) => f(&self.get_or_insert_with(entries, hash, make)),
        }
    }

    /// The value of `entries`, inserting `make()` when absent (the only path that allocates).
    pub fn get_or_insert_with(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        make: impl FnOnce() -> V,
    ) -> Arc<Keyed<V>> {
        self.get_or_insert_capped(entries, hash, u64::MAX, make)
            .expect("no cap")
    }

    /// As [`get_or_insert_with`](Self::get_or_insert_with), but inserts only while fewer than
    /// `max` keys are held; `None` when the key is absent and the table is full. The place is
    /// reserved atomically, so new keys racing in other shards never overshoot `max`.
    pub fn get_or_insert_capped(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        max: u64,
        make: impl FnOnce() -> V,
    ) -> Option<Arc<Keyed<V>>> {
        if let Some(v) = self.get(entries, hash) {
            return Some(v);
        }
        let eq = |s: &Arc<Keyed<V>>| s.hash == hash && key_matches(entries, &s.key);
        let mut shard = self.shard(hash).write();
        if let Some(s) = shard.find(hash, eq) {
            return Some(s.clone());
        }
        self.len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                (l < max).then_some(l + 1)
            })
            .ok()?;
        let v = Arc::new(Keyed {
            key: encode_key(entries),
            hash,
            value: make(),
        });
        shard.insert_unique(hash, v.clone(), |s| s.hash);
        Some(v)
    }

    /// Removes every key for which `keep` returns false; returns how many were removed.
    pub fn retain(&self, mut keep: impl FnMut(&Keyed<V>) -> bool) -> u64 {
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            shard.write().retain(|v| {
                let k = keep(v);
                if !k {
                    removed += 1;
                }
                k
            });
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Calls `f` with every key (each shard's read lock is held while its keys are visited).
    pub fn for_each(&self, mut f: impl FnMut(&Arc<Keyed<V>>)) {
        for shard in self.shards.iter() {
            for v in shard.read().iter() {
                f(v);
            }
        }
    }

    /// A copy of every entry's `Arc`, for work that must not hold shard locks (e.g. network).
    pub fn snapshot(&self) -> Vec<Arc<Keyed<V>>> {
        let mut out = Vec::with_capacity(self.len() as usize);
        self.for_each(|v| out.push(v.clone()));
        out
    }
}

/// State of one key under its mutex.
#[derive(Debug)]
pub struct SlotState {
    /// Set when eviction removed the slot from its table; the holder must look the key up again.
    pub evicted: bool,
    /// The parameters `state` was last decided under (to detect a policy change).
    pub params: LimitParams,
    /// The config version `params` belong to. State only ever moves to a newer version: a
    /// decision still holding an older snapshot decides with these (newer) parameters instead
    /// of moving the state back (design §10 "Config versions").
    pub version: u64,
    /// The algorithm state.
    pub state: LimitState,
}

impl SlotState {
    /// Moves the state to `params` of config `version` as of `at` (design §10 "Config versions"),
    /// unless it already holds a version at least as new; returns the parameters to decide with
    /// (the newest).
    #[inline]
    pub fn advance(&mut self, params: &LimitParams, version: u64, at: Nanos) -> LimitParams {
        if self.version < version {
            if self.params != *params {
                let st = std::mem::replace(&mut self.state, params.initial_state(at));
                self.state = params.transition_from(&self.params, st, at);
                self.params = *params;
            }
            self.version = version;
        }
        self.params
    }
}

/// One key's slot: its state behind a mutex; lock it for a decision.
pub type Slot = Keyed<Mutex<SlotState>>;

/// The table is at its `max_keys` and none of its keys is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rule keeps state for {max} keys already and none is idle")]
pub struct TableFull {
    /// The cap.
    pub max: u64,
}

/// All keys of one rule, with a cap on their number.
pub struct KeyTable {
    table: ShardedTable<Mutex<SlotState>>,
    max_keys: AtomicU64,
    next_sweep: AtomicU64,
}

impl std::fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyTable")
            .field("len", &self.len())
            .field("max_keys", &self.max_keys.load(Ordering::Relaxed))
            .finish()
    }
}

impl KeyTable {
    /// An empty table keeping at most `max_keys` keys.
    pub fn new(max_keys: u64) -> Self {
        KeyTable {
            table: ShardedTable::default(),
            max_keys: AtomicU64::new(max_keys.max(1)),
            next_sweep: AtomicU64::new(0),
        }
    }

    /// Changes the cap (a new config version); existing keys above it are evicted as they idle.
    pub fn set_max_keys(&self, max_keys: u64) {
        self.max_keys.store(max_keys.max(1), Ordering::Relaxed);
    }

    /// Number of keys held.
    pub fn len(&self) -> u64 {
        self.table.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Hash of a key's entries under this table's seed.
    #[inline]
    pub fn hash(&self, entries: &[Entry<'_>]) -> u64 {
        self.table.hash(entries)
    }

    /// The slot of `entries`, created with `params`' initial state at `now` when new.
    ///
    /// # Errors
    /// [`TableFull`] when the key is new, the table is at its cap and a sweep frees nothing.
    pub fn slot(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        params: &LimitParams,
        version: u64,
        now: Nanos,
    ) -> Result<Arc<Slot>, TableFull> {
        if let Some(s) = self.table.get(entries, hash) {
            return Ok(s);
        }
        let max = self.max_keys.load(Ordering::Relaxed);
        if self.len() >= max {
            self.sweep(now);
            if self.len() >= max {
                return Err(TableFull { max });
            }
        }
        self.table
            .get_or_insert_capped(entries, hash, max, || {
                Mutex::new(SlotState {
                    evicted: false,
                    params: *params,
                    version,
                    state: params.initial_state(now),
                })
            })
            .ok_or(TableFull { max })
    }

    /// Calls `f` with the slot of `entries` (created as by [`slot`](Self::slot) when new). A
    /// slot already present is lent under its shard's read lock, so eviction cannot remove it
    /// while `f` runs and no reference count is touched: the hot path of a single-descriptor
    /// decision. `f` may lock the slot but must not take this table's locks.
    ///
    /// # Errors
    /// [`TableFull`] as for [`slot`](Self::slot); `f` is not called then.
    #[inline]
    pub fn with_slot<R>(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        params: &LimitParams,
        version: u64,
        now: Nanos,
        f: impl FnOnce(&Slot) -> R,
    ) -> Result<R, TableFull> {
        match self.table.try_with(entries, hash, |s| f(s)) {
            Ok(r) => Ok(r),
            Err(f) => Ok(f(&self.slot(entries, hash, params, version, now)?)),
        }
    }

    /// Evicts every idle key (one whose state equals a fresh one at `now`); returns how many.
    /// After a sweep that frees nothing, further sweeps wait [`SWEEP_BACKOFF_NS`].
    pub fn sweep(&self, now: Nanos) -> u64 {
        if now < self.next_sweep.load(Ordering::Relaxed) {
            return 0;
        }
        let removed = self.table.retain(|slot| {
            // A slot locked right now is in use: not idle.
            let Some(mut g) = slot.value.try_lock() else {
                return true;
            };
            if g.evicted || g.params.is_idle(&g.state, now) {
                g.evicted = true;
                false
            } else {
                true
            }
        });
        if removed == 0 {
            self.next_sweep
                .store(now.saturating_add(SWEEP_BACKOFF_NS), Ordering::Relaxed);
        }
        removed
    }

    /// Moves every key's state to `params` as of `at` (design §10 "Config versions"), so a later
    /// config change cannot skip this version's period. Keys created concurrently under the old
    /// version are transitioned lazily by the limiter on their next decision.
    pub fn transition_all(&self, params: &LimitParams, version: u64, at: Nanos) {
        self.table.for_each(|slot| {
            let mut g = slot.value.lock();
            if !g.evicted {
                g.advance(params, version, at);
            }
        });
    }

    /// Every key and its state, for status pages and tests (takes each shard's read lock).
    pub fn for_each(&self, mut f: impl FnMut(&[u8], &SlotState)) {
        self.table.for_each(|slot| {
            let g = slot.value.lock();
            f(slot.key(), &g);
        });
    }
}
