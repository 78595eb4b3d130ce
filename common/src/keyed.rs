//! Per-key state of one rule: a sharded hash table of slots with a cap on distinct keys and
//! eviction of idle state (seed §3: memory stays bounded however random the keys are).
//!
//! Concurrency: a lookup takes one shard's read lock only long enough to clone the slot's `Arc`;
//! the decision then holds that one slot's mutex, so concurrent decisions on one key serialise
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

/// State of one key under its mutex.
#[derive(Debug)]
pub struct SlotState {
    /// Set when eviction removed the slot from its table; the holder must look the key up again.
    pub evicted: bool,
    /// The parameters `state` was last decided under (to detect a policy change).
    pub params: LimitParams,
    /// The algorithm state.
    pub state: LimitState,
}

/// One key's slot.
#[derive(Debug)]
pub struct Slot {
    key: Box<[u8]>,
    hash: u64,
    /// The key's state; lock it for a decision.
    pub state: Mutex<SlotState>,
}

impl Slot {
    /// The canonical key (see [`crate::descriptor::encode_key`]).
    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

/// The table is at its `max_keys` and none of its keys is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rule keeps state for {max} keys already and none is idle")]
pub struct TableFull {
    /// The cap.
    pub max: u64,
}

/// All keys of one rule.
pub struct KeyTable {
    shards: Box<[RwLock<HashTable<Arc<Slot>>>]>,
    hasher: foldhash::quality::RandomState,
    len: AtomicU64,
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
            shards: (0..SHARDS).map(|_| RwLock::new(HashTable::new())).collect(),
            hasher: foldhash::quality::RandomState::default(),
            len: AtomicU64::new(0),
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
    fn shard(&self, hash: u64) -> &RwLock<HashTable<Arc<Slot>>> {
        &self.shards[(hash >> 60) as usize % SHARDS]
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
        now: Nanos,
    ) -> Result<Arc<Slot>, TableFull> {
        let eq = |s: &Arc<Slot>| s.hash == hash && key_matches(entries, &s.key);
        if let Some(s) = self.shard(hash).read().find(hash, eq) {
            return Ok(s.clone());
        }
        let max = self.max_keys.load(Ordering::Relaxed);
        if self.len() >= max {
            self.sweep(now);
            if self.len() >= max {
                return Err(TableFull { max });
            }
        }
        let mut shard = self.shard(hash).write();
        if let Some(s) = shard.find(hash, eq) {
            return Ok(s.clone());
        }
        let slot = Arc::new(Slot {
            key: encode_key(entries),
            hash,
            state: Mutex::new(SlotState {
                evicted: false,
                params: *params,
                state: params.initial_state(now),
            }),
        });
        shard.insert_unique(hash, slot.clone(), |s| s.hash);
        self.len.fetch_add(1, Ordering::Relaxed);
        Ok(slot)
    }

    /// Evicts every idle key (one whose state equals a fresh one at `now`); returns how many.
    /// After a sweep that frees nothing, further sweeps wait [`SWEEP_BACKOFF_NS`].
    pub fn sweep(&self, now: Nanos) -> u64 {
        if now < self.next_sweep.load(Ordering::Relaxed) {
            return 0;
        }
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            shard.write().retain(|slot| {
                // A slot locked right now is in use: not idle.
                let Some(mut g) = slot.state.try_lock() else {
                    return true;
                };
                if g.evicted || g.params.is_idle(&g.state, now) {
                    g.evicted = true;
                    removed += 1;
                    false
                } else {
                    true
                }
            });
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        if removed == 0 {
            self.next_sweep
                .store(now.saturating_add(SWEEP_BACKOFF_NS), Ordering::Relaxed);
        }
        removed
    }

    /// Moves every key's state to `params` as of `at` (seed §28), so a later config change
    /// cannot skip this version's period. Keys created concurrently under the old version are
    /// transitioned lazily by the limiter on their next decision.
    pub fn transition_all(&self, params: &LimitParams, at: Nanos) {
        for shard in self.shards.iter() {
            for slot in shard.read().iter() {
                let mut g = slot.state.lock();
                if g.evicted || g.params == *params {
                    continue;
                }
                let old = g.params;
                let st = std::mem::replace(&mut g.state, params.initial_state(at));
                g.state = params.transition_from(&old, st, at);
                g.params = *params;
            }
        }
    }

    /// Every key and its state, for status pages and tests (takes each shard's read lock).
    pub fn for_each(&self, mut f: impl FnMut(&[u8], &SlotState)) {
        for shard in self.shards.iter() {
            for slot in shard.read().iter() {
                let g = slot.state.lock();
                f(&slot.key, &g);
            }
        }
    }
}
