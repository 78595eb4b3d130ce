//! The Raft log and vote, stored in sled.
//!
//! Tree `log`: key = entry index as big-endian `u64` (so byte order is index order), value =
//! bincode-2 entry. Tree `meta`: the vote, the last committed log id and the last purged log id,
//! bincode-2 encoded.

// openraft's storage traits return `StorageError` by value; the helpers here return the same
// type so `?` composes without boxing.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{
    LogId, LogState, OptionalSend, RaftLogId, RaftLogReader, RaftTypeConfig, StorageError,
    StorageIOError, Vote,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::codec::{decode, encode};
use super::flush::Flush;
use super::types::NodeId;

/// Name of the sled tree holding log entries.
pub const LOG_TREE: &str = "log";
/// Name of the sled tree holding vote, committed and last purged log ids.
pub const META_TREE: &str = "meta";

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_LAST_PURGED: &[u8] = b"last_purged";

/// Raft log storage on two trees of one sled database.
///
/// Cloning is cheap and clones share the same trees, which is what the log reader handed to
/// replication tasks relies on.
pub struct SledLogStore<C> {
    db: sled::Db,
    log: sled::Tree,
    meta: sled::Tree,
    flush: Flush,
    _types: PhantomData<fn() -> C>,
}

impl<C> Clone for SledLogStore<C> {
    fn clone(&self) -> Self {
        Self {
            db: self.db.clone(),
            log: self.log.clone(),
            meta: self.meta.clone(),
            flush: self.flush,
            _types: PhantomData,
        }
    }
}

impl<C> Debug for SledLogStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledLogStore")
            .field("entries", &self.log.len())
            .finish()
    }
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

impl<C> SledLogStore<C>
where
    C: RaftTypeConfig<NodeId = NodeId>,
    C::Entry: Serialize + DeserializeOwned,
{
    /// Opens (creating if needed) the `log` and `meta` trees of `db`.
    ///
    /// # Errors
    /// The sled error when a tree cannot be opened.
    pub fn open(db: &sled::Db) -> Result<Self, sled::Error> {
        Ok(Self {
            db: db.clone(),
            log: db.open_tree(LOG_TREE)?,
            meta: db.open_tree(META_TREE)?,
            flush: Flush::default(),
            _types: PhantomData,
        })
    }

    /// The same store flushing the `flush` way ([`Flush::Background`] unless told).
    #[must_use]
    pub fn with_flush(mut self, flush: Flush) -> Self {
        self.flush = flush;
        self
    }

    fn read_meta<T: DeserializeOwned>(
        &self,
        key: &[u8],
        on_err: fn(openraft::AnyError) -> StorageIOError<NodeId>,
    ) -> Result<Option<T>, StorageError<NodeId>> {
        let bytes = self
            .meta
            .get(key)
            .map_err(|e| on_err(openraft::AnyError::new(&e)))?;
        match bytes {
            None => Ok(None),
            Some(b) => decode(&b)
                .map(Some)
                .map_err(|e| on_err(openraft::AnyError::new(&e)).into()),
        }
    }

    fn write_meta<T: Serialize>(
        &self,
        key: &[u8],
        value: &T,
        on_err: fn(openraft::AnyError) -> StorageIOError<NodeId>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = encode(value).map_err(|e| on_err(openraft::AnyError::new(&e)))?;
        self.meta
            .insert(key, bytes)
            .map_err(|e| on_err(openraft::AnyError::new(&e)))?;
        Ok(())
    }

    fn last_purged(&self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        self.read_meta(KEY_LAST_PURGED, StorageIOError::read_logs)
    }

    fn decode_entry(bytes: &[u8]) -> Result<C::Entry, StorageError<NodeId>> {
        decode(bytes).map_err(|e| StorageIOError::read_logs(&e).into())
    }
}

/// Purged entries removed per sled batch ([`remove_purged`]).
///
/// sled applies every batch under one write lock shared by every database of the process
/// (sled 0.34's `concurrency_control`), the log's appends included, which take it for their own
/// batches on a runtime thread. Removing a snapshot interval's 5,000 entries in one batch
/// held it for tens of ms: every node's appends, and the runtime threads doing them, waited,
/// and each snapshot showed as a 20–60 ms stall of every call (`cargo bench -p allot-allocator
/// --bench cluster -- --only at-rate --secs 60`: p99 13–15 ms with the removal, 6–7 ms
/// without it; docs/benchmarks.md). 64 entries take well under a millisecond.
pub const PURGE_CHUNK: usize = 64;

/// The pause between two chunks of [`remove_purged`] when it runs in the background, so that an
/// append waiting for the lock gets it before the next chunk (parking_lot's lock may be taken
/// again by the thread that just released it).
pub const PURGE_PAUSE: std::time::Duration = std::time::Duration::from_micros(500);

/// What [`remove_purged`] removed: entries, in how many sled batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Removed {
    entries: usize,
    batches: usize,
}

/// Removes the log's entries up to `upto` (its index key, included) in batches of at most
/// `chunk` entries (at least one), pausing `pause` between two batches. Blocking. Not atomic:
/// the caller recorded the purge point first, so entries left by an interruption are never
/// served and the next purge removes them.
fn remove_purged(
    log: &sled::Tree,
    upto: [u8; 8],
    chunk: usize,
    pause: std::time::Duration,
) -> sled::Result<Removed> {
    let mut n = Removed::default();
    loop {
        // From the start each time: what the previous batch removed is gone.
        let keys = log
            .range(..=upto)
            .keys()
            .take(chunk.max(1))
            .collect::<sled::Result<Vec<_>>>()?;
        if keys.is_empty() {
            return Ok(n);
        }
        let mut batch = sled::Batch::default();
        n.entries += keys.len();
        n.batches += 1;
        for key in keys {
            batch.remove(key);
        }
        log.apply_batch(batch)?;
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
}

/// Removes the log's entries whose keys fall in `keys`, in one batch; returns how many.
/// Blocking.
fn remove_range(log: &sled::Tree, keys: impl RangeBounds<[u8; 8]>) -> sled::Result<usize> {
    let mut batch = sled::Batch::default();
    let mut n = 0;
    for key in log.range(keys).keys() {
        batch.remove(key?);
        n += 1;
    }
    log.apply_batch(batch)?;
    Ok(n)
}

impl<C> RaftLogReader<C> for SledLogStore<C>
where
    C: RaftTypeConfig<NodeId = NodeId>,
    C::Entry: Serialize + DeserializeOwned,
{
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<C::Entry>, StorageError<NodeId>> {
        // An excluded start of u64::MAX is an empty range; checked_add keeps that from wrapping.
        let asked = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => match i.checked_add(1) {
                Some(next) => next,
                None => return Ok(Vec::new()),
            },
            Bound::Unbounded => 0,
        };
        // Purged entries are never served, also while their removal runs in the background
        // (`purge`) or after a crash interrupted it.
        let first = match self.last_purged()? {
            Some(p) => match p.index.checked_add(1) {
                Some(next) => asked.max(next),
                None => return Ok(Vec::new()),
            },
            None => asked,
        };
        let start = Bound::Included(index_key(first));
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(index_key(*i)),
            Bound::Excluded(i) => Bound::Excluded(index_key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        if let (Bound::Included(s), Bound::Excluded(e)) = (&start, &end) {
            // sled panics on a range whose start is after its end.
            if s >= e {
                return Ok(Vec::new());
            }
        }
        if let (Bound::Included(s), Bound::Included(e)) = (&start, &end) {
            if s > e {
                return Ok(Vec::new());
            }
        }
        let mut entries = Vec::new();
        for item in self.log.range::<[u8; 8], _>((start, end)) {
            let (_, value) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            entries.push(Self::decode_entry(&value)?);
        }
        Ok(entries)
    }
}

impl<C> RaftLogStorage<C> for SledLogStore<C>
where
    C: RaftTypeConfig<NodeId = NodeId>,
    C::Entry: Serialize + DeserializeOwned,
{
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, StorageError<NodeId>> {
        let last_purged_log_id = self.last_purged()?;
        let last = self.log.last().map_err(|e| StorageIOError::read_logs(&e))?;
        // max() covers a crash between recording a purge and removing its entries.
        let last_log_id = match last {
            Some((_, value)) => {
                let last_entry = Some(*Self::decode_entry(&value)?.get_log_id());
                std::cmp::max(last_entry, last_purged_log_id)
            }
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.write_meta(KEY_VOTE, vote, StorageIOError::write_vote)?;
        // Raft safety needs the vote on disk before any reply that depends on it.
        self.flush
            .run(&self.meta)
            .await
            .map_err(|e| StorageIOError::write_vote(&e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.read_meta(KEY_VOTE, StorageIOError::read_vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        // Not flushed: after a crash a smaller committed only delays re-applying entries, it
        // never makes an uncommitted entry look committed because later writes flush it.
        self.write_meta(KEY_COMMITTED, &committed, StorageIOError::write)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self
            .read_meta::<Option<LogId<NodeId>>>(KEY_COMMITTED, StorageIOError::read)?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<C>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = C::Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = sled::Batch::default();
        for entry in entries {
            let log_id = *entry.get_log_id();
            let value = encode(&entry).map_err(|e| StorageIOError::write_log_entry(log_id, &e))?;
            batch.insert(&index_key(log_id.index), value);
        }
        self.log
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        let flushed = self.flush.run(&self.log).await;
        callback.log_io_completed(flushed.map(|_| ()).map_err(std::io::Error::other));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        remove_range(&self.log, index_key(log_id.index)..)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        self.flush
            .run(&self.log)
            .await
            .map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        // Record the purge point first: if we crash before the entries are removed, the log
        // state still reports them as purged and they are never served.
        self.write_meta(KEY_LAST_PURGED, &log_id, StorageIOError::write_logs)?;
        self.flush
            .run(&self.meta)
            .await
            .map_err(|e| StorageIOError::write_logs(&e))?;
        // Removing thousands of entries takes tens of ms (34 ms for 5,000 in the cluster bench)
        // while openraft's core awaits this call and moves nothing; the purge point above
        // already makes them unreadable, so they are removed in the background, a chunk at a
        // time so that appends are not held behind them (`PURGE_CHUNK`).
        let log = self.log.clone();
        // A simulation removes them at once, on simulated time (no pause).
        let pause = match self.flush {
            Flush::Background => PURGE_PAUSE,
            Flush::Inline => std::time::Duration::ZERO,
        };
        self.flush.detach(move || {
            let started = std::time::Instant::now();
            match remove_purged(&log, index_key(log_id.index), PURGE_CHUNK, pause) {
                Ok(n) => tracing::debug!(
                    entries = n.entries,
                    batches = n.batches,
                    upto = log_id.index,
                    took_ms = started.elapsed().as_millis() as u64,
                    "purged log entries removed"
                ),
                Err(e) => tracing::warn!(error = %e, upto = log_id.index, "removing purged log entries failed; they stay unreadable"),
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(indexes: std::ops::Range<u64>) -> sled::Tree {
        let db = sled::Config::new()
            .temporary(true)
            .open()
            .expect("temporary sled");
        let log = db.open_tree("log").expect("tree");
        for i in indexes {
            log.insert(index_key(i), &i.to_be_bytes()).expect("insert");
        }
        log
    }

    fn left(log: &sled::Tree) -> Vec<u64> {
        log.iter()
            .keys()
            .map(|k| u64::from_be_bytes(k.expect("key").as_ref().try_into().expect("8 bytes")))
            .collect()
    }

    fn removed(entries: usize, batches: usize) -> Removed {
        Removed { entries, batches }
    }

    #[test]
    fn purged_entries_go_in_chunks_up_to_the_index_and_no_further() {
        let log = log_of(1..301);
        let zero = std::time::Duration::ZERO;
        // 150 entries in chunks of 64: three batches (64, 64, 22).
        assert_eq!(
            remove_purged(&log, index_key(150), 64, zero).unwrap(),
            removed(150, 3)
        );
        assert_eq!(left(&log), (151..301).collect::<Vec<_>>());
        // Nothing left up to there: nothing removed, no batch.
        assert_eq!(
            remove_purged(&log, index_key(150), 64, zero).unwrap(),
            removed(0, 0)
        );
        // A chunk of 0 still moves forward, one entry a batch; an exact multiple of the chunk.
        assert_eq!(
            remove_purged(&log, index_key(152), 0, zero).unwrap(),
            removed(2, 2)
        );
        assert_eq!(
            remove_purged(&log, index_key(216), 64, zero).unwrap(),
            removed(64, 1)
        );
        assert_eq!(left(&log).first(), Some(&217));
        // Up to the last index and past it: everything, with the pause production uses.
        assert_eq!(
            remove_purged(&log, index_key(u64::MAX), 64, PURGE_PAUSE).unwrap(),
            removed(84, 2)
        );
        assert!(left(&log).is_empty());
    }
}
