//! Per-key state of one rule: a sharded hash table of slots with a cap on distinct keys and
//! eviction of idle state (design §10 "Keys": memory stays bounded however random the keys are).
//!
//! Concurrency: a lookup takes one shard's read lock, either just long enough to clone the slot's
//! `Arc` or, on the one-descriptor path ([`KeyTable::decide`]), for the decision itself. A key's
//! state is a [`StateCell`]: a bucket whose numbers fit is decided with one compare-and-swap of
//! its packed word, anything else under the cell's lock, so concurrent decisions on one key
//! never spend a token twice while different keys never contend. There is no global lock.
//!
//! A compare-and-swap decision reads the slot's config version and then its word; it uses the
//! parameters of its own snapshot, which are the slot's when the versions are equal. So that no
//! version change can fall between those reads and the compare-and-swap (and a word that
//! happens to look the same under new parameters be replaced on the strength of the old ones),
//! a slot's version changes only under its shard's *write* lock ([`KeyTable::advance`],
//! [`KeyTable::transition_all`]), which excludes every such decision on the shard. A slot
//! removed by eviction (under the write lock too) is marked `evicted` under its cell's lock, and
//! a decision that finds that mark looks the key up again, so it never spends on an orphaned
//! slot.
//!
//! Lock order, which keeps all of this deadlock-free: a shard's lock before a cell's lock, and
//! a thread holding a cell's lock never waits for a shard's lock.

use crate::algorithm::{LimitParams, LimitState};
use crate::cell::{CellGuard, Packs, StateCell};
use crate::decision::Decision;
use crate::descriptor::{encode_key, hash_entries, key_matches, Entry};
use crate::units::{Micros, Nanos, NANOS_PER_SEC};
use hashbrown::HashTable;
use parking_lot::RwLock;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SHARDS: usize = 16;

/// Shortest time between two eviction sweeps of a full table that found nothing idle: bounds the
/// work a flood of new keys can cause once every slot is in use.
pub const SWEEP_BACKOFF_NS: Nanos = NANOS_PER_SEC;

/// A shard: the keys' `Arc`s (8 bytes a bucket, so more of a large table stays in cache). A
/// probe compares the key itself: hashbrown's 7-bit tag already filters out all but about one
/// in 128 candidates, and the key lies in the line the decision reads next anyway.
type Shard<V> = RwLock<HashTable<Arc<Keyed<V>>>>;

/// One key of a [`ShardedTable`] and its value.
///
/// Cache-line aligned, with the key (its bytes inline when short) first and the value next, so
/// a lookup that finds the key reads two adjacent lines for the comparison and the start of
/// the value (for a [`SlotCell`], everything its compare-and-swap path reads), instead of
/// following a pointer to the key's bytes elsewhere.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Keyed<V> {
    key: KeyBytes,
    /// The key's value.
    pub value: V,
    hash: u64,
}

impl<V> Keyed<V> {
    /// The canonical key (see [`crate::descriptor::encode_key`]).
    #[inline]
    pub fn key(&self) -> &[u8] {
        self.key.as_slice()
    }
}

/// Longest canonical key kept inline in its [`Keyed`] (a one-entry key of up to 22 bytes of key
/// and value together, with the 8 bytes of length prefixes): [`KeyBytes`] is then 32 bytes, and
/// a [`SlotCell`]'s version and word fill the rest of the key's cache line, the one line a
/// compare-and-swap decision reads.
const INLINE_KEY: usize = 30;

/// A canonical key's bytes: inline when short, else on the heap.
#[derive(Debug)]
enum KeyBytes {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl KeyBytes {
    fn new(key: Box<[u8]>) -> Self {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0u8; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(&key);
            KeyBytes::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            KeyBytes::Heap(key)
        }
    }

    #[inline]
    fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyBytes::Heap(b) => b,
        }
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
        let eq = |s: &Arc<Keyed<V>>| key_matches(entries, s.key());
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
        let eq = |s: &Arc<Keyed<V>>| key_matches(entries, s.key());
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
        let eq = |s: &Arc<Keyed<V>>| key_matches(entries, s.key());
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
            key: KeyBytes::new(encode_key(entries)),
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

    /// Calls `f` with every key while its shard's *write* lock is held: no lookup of that shard
    /// runs meanwhile.
    pub fn for_each_exclusive(&self, mut f: impl FnMut(&Arc<Keyed<V>>)) {
        for shard in self.shards.iter() {
            for v in shard.write().iter() {
                f(v);
            }
        }
    }

    /// Runs `f` while the write lock of the shard that holds keys of hash `hash` is held.
    pub fn with_shard_exclusive<R>(&self, hash: u64, f: impl FnOnce() -> R) -> R {
        let _excluded = self.shard(hash).write();
        f()
    }

    /// A copy of every entry's `Arc`, for work that must not hold shard locks (e.g. network).
    pub fn snapshot(&self) -> Vec<Arc<Keyed<V>>> {
        let mut out = Vec::with_capacity(self.len() as usize);
        self.for_each(|v| out.push(v.clone()));
        out
    }
}

/// State of one key under its cell's lock.
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
    /// (the newest). Only [`KeyTable`] calls it, under the shard's write lock (see the module
    /// doc).
    #[inline]
    fn advance(&mut self, params: &LimitParams, version: u64, at: Nanos) -> LimitParams {
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

/// A slot's state carries its parameters: it packs by itself.
impl Packs<()> for SlotState {
    #[inline]
    fn pack(&self, _: &()) -> Option<u128> {
        if self.evicted {
            return None;
        }
        self.params.pack(&self.state)
    }

    #[inline]
    fn unpack(&mut self, _: &(), word: u128) {
        if let Some(s) = self.params.unpack(word) {
            self.state = s;
        }
    }
}

/// One key's state: its [`StateCell`] and its config version as the compare-and-swap path reads
/// it (the same as the locked state's `version`; both change only under the shard's write lock).
#[derive(Debug)]
#[repr(C)]
pub struct SlotCell {
    // The two fields a compare-and-swap decision reads, next to each other.
    version: AtomicU64,
    cell: StateCell<SlotState>,
}

impl SlotCell {
    fn new(state: SlotState) -> Self {
        SlotCell {
            version: AtomicU64::new(state.version),
            cell: StateCell::new(state, &()),
        }
    }

    /// Locks the key's state (a packed state is taken into the lock until the guard drops).
    #[inline]
    pub fn lock(&self) -> CellGuard<'_, SlotState> {
        self.cell.lock(&())
    }

    /// One check-and-spend of `cost` at `now` for a decision of config `version` whose rule has
    /// `params`. Called only under the shard's read lock (see the module doc).
    #[inline]
    fn decide_shared(
        &self,
        params: &LimitParams,
        version: u64,
        now: Nanos,
        cost: Micros,
    ) -> Attempt {
        let seen = self.version.load(Ordering::Relaxed);
        if seen == version {
            let packed = self.cell.update(|w| params.decide_word(w, now, cost));
            if let Some(d) = packed {
                return Attempt::Decided(d);
            }
        } else if seen < version {
            return Attempt::Behind;
        }
        let mut g = self.cell.lock(&());
        if g.evicted {
            return Attempt::Evicted;
        }
        if g.version < version {
            return Attempt::Behind;
        }
        // A newer version than the decision's: decide with its (newer) parameters.
        let p = g.params;
        let d = p.check(&mut g.state, now, cost);
        if d.allowed {
            p.spend(&mut g.state, now, cost);
        }
        Attempt::Decided(d)
    }
}

/// How one try of [`KeyTable::decide`] ended.
enum Attempt {
    Decided(Decision),
    /// The slot is at an older config version than the decision: advance it, then retry.
    Behind,
    /// Eviction removed the slot under us.
    Evicted,
}

/// Most tries of [`KeyTable::decide`] (a key created, a slot advanced) before it gives up.
const MAX_TRIES: usize = 4;

/// One key's slot: its state in a cell; see [`SlotCell`].
pub type Slot = Keyed<SlotCell>;

/// The table is at its `max_keys` and none of its keys is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rule keeps state for {max} keys already and none is idle")]
pub struct TableFull {
    /// The cap.
    pub max: u64,
}

/// All keys of one rule, with a cap on their number.
pub struct KeyTable {
    table: ShardedTable<SlotCell>,
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
                SlotCell::new(SlotState {
                    evicted: false,
                    params: *params,
                    version,
                    state: params.initial_state(now),
                })
            })
            .ok_or(TableFull { max })
    }

    /// Checks and, when allowed, spends `cost` at `now` on the key of `entries` (created as by
    /// [`slot`](Self::slot) when new) for a decision of config `version` (activated at `at`)
    /// whose rule has `params`: the hot path of a one-descriptor decision. The slot is lent
    /// under its shard's read lock, so no reference count is touched, and a packed state is
    /// decided with one compare-and-swap. A slot behind `version` is first moved to it (under
    /// the shard's write lock). `Ok(None)` when eviction raced the decision (nothing was
    /// spent; the caller decides again by the general path).
    ///
    /// # Errors
    /// [`TableFull`] as for [`slot`](Self::slot).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn decide(
        &self,
        entries: &[Entry<'_>],
        hash: u64,
        params: &LimitParams,
        version: u64,
        at: Nanos,
        now: Nanos,
        cost: Micros,
    ) -> Result<Option<Decision>, TableFull> {
        for _ in 0..MAX_TRIES {
            let tried = self.table.try_with(entries, hash, |s| {
                match s.value.decide_shared(params, version, now, cost) {
                    Attempt::Behind => Err(s.clone()),
                    other => Ok(other),
                }
            });
            match tried {
                Ok(Ok(Attempt::Decided(d))) => return Ok(Some(d)),
                Ok(Ok(_)) => return Ok(None),
                Ok(Err(behind)) => self.advance(&behind, params, version, at),
                Err(_) => {
                    self.slot(entries, hash, params, version, now)?;
                }
            }
        }
        Ok(None)
    }

    /// Moves `slot` (of this table) to `params` of config `version` as of `at`, unless it
    /// already holds a version at least as new or was evicted; under its shard's write lock
    /// (see the module doc). The caller must hold no cell's lock.
    pub fn advance(&self, slot: &Slot, params: &LimitParams, version: u64, at: Nanos) {
        self.table.with_shard_exclusive(slot.hash, || {
            let mut g = slot.value.lock();
            if !g.evicted {
                g.advance(params, version, at);
                slot.value.version.store(g.version, Ordering::Relaxed);
            }
        });
    }

    /// Evicts every idle key (one whose state equals a fresh one at `now`); returns how many.
    /// After a sweep that frees nothing, further sweeps wait [`SWEEP_BACKOFF_NS`].
    pub fn sweep(&self, now: Nanos) -> u64 {
        if now < self.next_sweep.load(Ordering::Relaxed) {
            return 0;
        }
        let removed = self.table.retain(|slot| {
            // A slot locked right now is in use: not idle.
            let Some(mut g) = slot.value.cell.try_lock(&()) else {
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
        self.table.for_each_exclusive(|slot| {
            let mut g = slot.value.lock();
            if !g.evicted {
                g.advance(params, version, at);
                slot.value.version.store(g.version, Ordering::Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a compare-and-swap decision reads of a slot (the key inline, the version, the
    /// word) lies in its first cache line.
    #[test]
    fn a_slot_s_hot_fields_share_one_cache_line() {
        assert_eq!(std::mem::align_of::<Slot>(), 64);
        let value = std::mem::offset_of!(Slot, value);
        let word_end = value + std::mem::offset_of!(SlotCell, cell) + 16;
        assert!(std::mem::offset_of!(Slot, key) + std::mem::size_of::<KeyBytes>() <= value);
        assert!(value + std::mem::offset_of!(SlotCell, version) + 8 <= 64);
        assert!(
            word_end <= 64,
            "the word ends at {word_end}: key {} bytes, value at {value}, cell at {}",
            std::mem::size_of::<KeyBytes>(),
            std::mem::offset_of!(SlotCell, cell)
        );
    }

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        let short = KeyBytes::new(vec![7u8; INLINE_KEY].into_boxed_slice());
        assert!(matches!(short, KeyBytes::Inline { .. }));
        assert_eq!(short.as_slice(), &[7u8; INLINE_KEY][..]);
        let long = KeyBytes::new(vec![9u8; INLINE_KEY + 1].into_boxed_slice());
        assert!(matches!(long, KeyBytes::Heap(_)));
        assert_eq!(long.as_slice().len(), INLINE_KEY + 1);
        assert_eq!(KeyBytes::new(Box::new([])).as_slice(), &[] as &[u8]);
    }
}
