//! The Raft state machine: the [`App`] plus Raft's bookkeeping, with its latest snapshot in a
//! file of the node's data folder ([`super::snapshot_file`]).
//!
//! Durability: the state machine's durable form is its latest snapshot. `apply` only changes
//! memory; on start the node restores the snapshot and openraft re-applies the committed entries
//! after it from the log (the log store persists the committed log id). This avoids rewriting the
//! whole application state on every entry.
//!
//! Snapshots were kept in sled tree `sm` before; sled held the whole encoded snapshot in its page
//! cache for as long as the process ran (issue 13 item 3). A node that finds one there moves it
//! to the file when it opens.

// openraft's storage traits return `StorageError` by value; the helpers here return the same
// type so `?` composes without boxing.
#![allow(clippy::result_large_err)]

use std::io::{self, Cursor, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership,
};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::app::{App, AppError};
use super::codec::{decode, decode_prefix, encode};
use super::flush::Flush;
use super::ledger_time::LedgerTime;
use super::node_clock::{NodeClock, SystemNodeClock};
use super::snapshot_file::SnapshotFile;
use super::types::{AllotRaft, NodeId, Stamped};
use crate::heap::release_free_memory;

/// Name of the sled tree where snapshots were kept before they moved to a file (read once, to
/// move a stored one).
pub const SM_TREE: &str = "sm";

const KEY_SNAPSHOT: &[u8] = b"snapshot";

type Meta = SnapshotMeta<NodeId, openraft::BasicNode>;
type Membership = StoredMembership<NodeId, openraft::BasicNode>;

/// Snapshot data: everything needed to rebuild the state machine.
#[derive(Serialize, Deserialize)]
struct SnapshotBody {
    last_applied: Option<LogId<NodeId>>,
    membership: Membership,
    last_stamped_ms: u64,
    app: Vec<u8>,
}

/// A stored snapshot: its meta, then its data (a [`SnapshotBody`]'s bytes). Encoded as bincode
/// encodes this struct, in the file as it was in sled ([`write_stored`], [`read_stored`]).
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: Meta,
    data: Vec<u8>,
}

/// Why the state machine could not be opened from disk.
#[derive(Debug, thiserror::Error)]
pub enum StateMachineError {
    /// sled failed to open the tree or read from it.
    #[error("state machine storage: {0}")]
    Sled(#[from] sled::Error),
    /// The snapshot file could not be read or written.
    #[error("snapshot file: {0}")]
    Io(#[from] io::Error),
    /// The stored snapshot does not decode.
    #[error("stored snapshot does not decode: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    /// The application rejected the stored snapshot.
    #[error(transparent)]
    App(#[from] AppError),
}

/// Writes the stored form of (`meta`, `data`) to `w`: the bytes bincode gives a
/// [`StoredSnapshot`], without copying `data` into a second buffer first (it is as large as
/// the state).
fn write_stored(meta: &Meta, data: &[u8], w: &mut dyn Write) -> io::Result<()> {
    let prefix = encode(&(meta, data.len() as u64)).map_err(io::Error::other)?;
    w.write_all(&prefix)?;
    w.write_all(data)
}

/// Reads what [`write_stored`] wrote (or sled held): the meta, then the data's length and bytes.
fn read_stored(bytes: &[u8]) -> Result<StoredSnapshot, bincode::error::DecodeError> {
    let (meta, at): (Meta, usize) = decode_prefix(bytes)?;
    let (len, n): (u64, usize) = decode_prefix(&bytes[at..])?;
    let data = &bytes[at + n..];
    if data.len() as u64 != len {
        return Err(bincode::error::DecodeError::OtherString(format!(
            "snapshot data of {} bytes where its length says {len}",
            data.len()
        )));
    }
    Ok(StoredSnapshot {
        meta,
        data: data.to_vec(),
    })
}

/// The bytes bincode gives a [`SnapshotBody`] of these fields, built in `app`'s own buffer:
/// the application's bytes are as large as the state, and encoding the body around them
/// would copy them into a second buffer as large.
fn body_bytes(
    last_applied: Option<LogId<NodeId>>,
    membership: &Membership,
    last_stamped_ms: u64,
    app: Vec<u8>,
) -> Result<Vec<u8>, bincode::error::EncodeError> {
    let head = encode(&(last_applied, membership, last_stamped_ms, app.len() as u64))?;
    let mut data = app;
    data.reserve_exact(head.len());
    data.extend_from_slice(&head);
    data.rotate_right(head.len());
    Ok(data)
}

/// The stored snapshot's file and the last log id it covers, shared by snapshot builders and
/// installation so that an older snapshot never replaces a newer one.
struct SnapshotStore {
    file: SnapshotFile,
    /// Last log id of the stored snapshot; `None` while none is stored.
    stored: Mutex<Option<Option<LogId<NodeId>>>>,
}

impl SnapshotStore {
    /// Stores (`meta`, `data`) unless a snapshot of a later log id is already stored; durable
    /// when it returns. Whether it stored them. Blocking file I/O.
    fn store(&self, meta: &Meta, data: &[u8]) -> io::Result<bool> {
        let mut stored = self.stored.lock();
        if matches!(*stored, Some(last) if last > meta.last_log_id) {
            return Ok(false);
        }
        self.file.replace(|w| write_stored(meta, data, w))?;
        *stored = Some(meta.last_log_id);
        Ok(true)
    }

    /// The stored snapshot, if any. Blocking file I/O.
    fn load(&self) -> io::Result<Option<StoredSnapshot>> {
        let Some(bytes) = self.file.read()? else {
            return Ok(None);
        };
        read_stored(&bytes).map(Some).map_err(io::Error::other)
    }
}

/// The latest stored snapshot of a node: its file's, or one kept in sled tree `sm` by an older
/// version, which is moved to the file (when newer) and out of sled (whose cache would hold it).
fn load_stored(
    file: &SnapshotFile,
    tree: &sled::Tree,
) -> Result<Option<StoredSnapshot>, StateMachineError> {
    let in_file = match file.read()? {
        Some(bytes) => Some(read_stored(&bytes)?),
        None => None,
    };
    let Some(bytes) = tree.get(KEY_SNAPSHOT)? else {
        return Ok(in_file);
    };
    let in_sled = read_stored(&bytes)?;
    drop(bytes);
    let newest = match in_file {
        Some(f) if f.meta.last_log_id >= in_sled.meta.last_log_id => f,
        _ => {
            file.replace(|w| write_stored(&in_sled.meta, &in_sled.data, w))?;
            in_sled
        }
    };
    // Only once the file holds it: a crash before this finds both and takes the file's.
    tree.remove(KEY_SNAPSHOT)?;
    tree.flush()?;
    Ok(Some(newest))
}

/// In-memory state: the application plus what Raft needs to know about it.
struct SmState<A> {
    last_applied: Option<LogId<NodeId>>,
    membership: Membership,
    /// Greatest stamped time applied so far, Unix ms; stamps below it are raised to it.
    last_stamped_ms: u64,
    app: A,
}

impl<A: App> SmState<A> {
    fn from_body(body: SnapshotBody) -> Result<Self, AppError> {
        Ok(Self {
            last_applied: body.last_applied,
            membership: body.membership,
            last_stamped_ms: body.last_stamped_ms,
            app: A::restore(&body.app)?,
        })
    }

    /// A copy for a snapshot builder.
    fn copy(&self) -> StateCopy<A> {
        StateCopy {
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            last_stamped_ms: self.last_stamped_ms,
            app: self.app.snapshot_copy(),
        }
    }
}

/// What a snapshot is built from: the state as it was when the builder was made.
struct StateCopy<A> {
    last_applied: Option<LogId<NodeId>>,
    membership: Membership,
    last_stamped_ms: u64,
    app: A,
}

/// Read access to the applied state, for serving reads and for tests. The state may lag the
/// leader; callers needing linearizable reads go through Raft first.
pub struct StateMachineHandle<A> {
    state: Arc<RwLock<SmState<A>>>,
}

impl<A> Clone for StateMachineHandle<A> {
    fn clone(&self) -> Self {
        Self {
            state: self.state.clone(),
        }
    }
}

impl<A: App> StateMachineHandle<A> {
    /// Runs `f` on the applied application state. The lock is held while `f` runs, which blocks
    /// `apply`: keep `f` short.
    pub fn read<R>(&self, f: impl FnOnce(&A) -> R) -> R {
        f(&self.state.read().app)
    }

    /// Index of the last applied entry, `None` before the first.
    pub fn last_applied_index(&self) -> Option<u64> {
        self.state.read().last_applied.map(|id| id.index)
    }

    /// Greatest stamped time applied so far, Unix ms (0 before the first command).
    pub fn last_stamped_ms(&self) -> u64 {
        self.state.read().last_stamped_ms
    }
}

/// The state machine of application `A`, with its latest snapshot in a file of the node's data
/// folder (its sled database serves only to move a snapshot an older version kept there).
pub struct SledStateMachine<A> {
    state: Arc<RwLock<SmState<A>>>,
    store: Arc<SnapshotStore>,
    snapshot_seq: Arc<AtomicU64>,
    /// This node's view of ledger time, told of every stamp applied, restored or installed.
    time: Arc<LedgerTime>,
    flush: Flush,
}

impl<A: App> SledStateMachine<A> {
    /// [`SledStateMachine::open_with_clock`] with the system clocks.
    ///
    /// # Errors
    /// As [`SledStateMachine::open_with_clock`].
    pub fn open(db: &sled::Db, dir: &Path) -> Result<Self, StateMachineError> {
        Self::open_with_clock(db, dir, Arc::new(SystemNodeClock))
    }

    /// Opens the state machine of the node whose data folder is `dir` (its sled database `db`),
    /// restoring it from the stored snapshot if there is one. `clock`'s monotonic time anchors
    /// the stamps it applies (see [`Self::ledger_time`]); the restored snapshot's last stamp is
    /// anchored at the moment of loading.
    ///
    /// # Errors
    /// [`StateMachineError`] when the snapshot cannot be read (or moved out of sled), or does not
    /// decode or restore.
    pub fn open_with_clock(
        db: &sled::Db,
        dir: &Path,
        clock: Arc<dyn NodeClock>,
    ) -> Result<Self, StateMachineError> {
        let file = SnapshotFile::in_dir(dir);
        let stored = load_stored(&file, &db.open_tree(SM_TREE)?)?;
        let last = stored.as_ref().map(|s| s.meta.last_log_id);
        let state = match stored {
            Some(stored) => SmState::from_body(decode(&stored.data)?)?,
            None => SmState {
                last_applied: None,
                membership: Membership::default(),
                last_stamped_ms: 0,
                app: A::default(),
            },
        };
        let time = Arc::new(LedgerTime::new(clock));
        time.applied(state.last_stamped_ms);
        Ok(Self {
            state: Arc::new(RwLock::new(state)),
            store: Arc::new(SnapshotStore {
                file,
                stored: Mutex::new(last),
            }),
            snapshot_seq: Arc::new(AtomicU64::new(0)),
            time,
            flush: Flush::default(),
        })
    }

    /// The same state machine writing snapshots the `flush` way ([`Flush::Background`] unless
    /// told).
    #[must_use]
    pub fn with_flush(mut self, flush: Flush) -> Self {
        self.flush = flush;
        self
    }

    /// This node's view of ledger time, which proposers stamp entries from (issue 10 item 2).
    pub fn ledger_time(&self) -> Arc<LedgerTime> {
        self.time.clone()
    }

    /// A read handle sharing this state machine's state.
    pub fn handle(&self) -> StateMachineHandle<A> {
        StateMachineHandle {
            state: self.state.clone(),
        }
    }
}

/// Builds snapshots from a copy of the state taken when the builder was created. The copy is
/// [`App::snapshot_copy`], taken under the state lock while openraft applies nothing: for the
/// ledger independent of its number of keys (copy-on-write tables; it copies one capped index
/// of 16 B entries and the admin answers),
/// where a deep copy stalled every apply on every node for ~1.5 µs per key at each snapshot.
/// The encoding, the slow part, runs in [`RaftSnapshotBuilder::build_snapshot`] without the
/// lock, on a thread of its own at a low CPU priority ([`Flush::in_background`]), so `apply`
/// never waits for it (issue 10 item 1) and the runtime's threads take the CPU first;
/// meanwhile the ledger's writes copy the nodes they change instead of changing the copy's.
/// What the copy left out is rebuilt there ([`App::into_snapshot`]), and the file is written
/// back to disk in chunks (`snapshot_file`), so the Raft log's own `fsync`s do not queue
/// behind it.
pub struct SledSnapshotBuilder<A> {
    store: Arc<SnapshotStore>,
    seq: u64,
    /// Taken by the first build.
    copy: Option<StateCopy<A>>,
    flush: Flush,
}

/// The snapshot of `copy` (numbered `seq`), encoded and stored; the copy is freed as soon as
/// it is encoded and the freed memory handed back to the system. Blocking.
fn build_and_store<A: App>(
    store: &SnapshotStore,
    seq: u64,
    copy: StateCopy<A>,
) -> Result<Snapshot<AllotRaft<A>>, StorageError<NodeId>> {
    let started = std::time::Instant::now();
    let snapshot_id = match copy.last_applied {
        Some(id) => format!("{}-{}-{}", id.leader_id, id.index, seq),
        None => format!("none-{seq}"),
    };
    let meta = Meta {
        last_log_id: copy.last_applied,
        last_membership: copy.membership.clone(),
        snapshot_id,
    };
    let app = copy.app.into_snapshot();
    // The copy's own nodes (those the state replaced while it was encoded, and its copied
    // indexes) are freed now: hand their pages back to the system.
    release_free_memory();
    let data = body_bytes(
        copy.last_applied,
        &copy.membership,
        copy.last_stamped_ms,
        app,
    )
    .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
    let encode_ms = started.elapsed().as_millis() as u64;
    let stored = store
        .store(&meta, &data)
        .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
    tracing::info!(
        snapshot = %meta.snapshot_id,
        bytes = data.len(),
        build_ms = started.elapsed().as_millis() as u64,
        encode_ms,
        stored,
        "snapshot built"
    );
    Ok(Snapshot {
        meta,
        snapshot: Box::new(Cursor::new(data)),
    })
}

impl<A: App> RaftSnapshotBuilder<AllotRaft<A>> for SledSnapshotBuilder<A> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<AllotRaft<A>>, StorageError<NodeId>> {
        let copy = self.copy.take().ok_or_else(|| {
            StorageIOError::write_snapshot(None, &io::Error::other("the builder was used"))
        })?;
        let (store, seq) = (self.store.clone(), self.seq);
        self.flush
            .in_background(move || build_and_store(&store, seq, copy))
            .await
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?
    }
}

impl<A: App> RaftStateMachine<AllotRaft<A>> for SledStateMachine<A> {
    type SnapshotBuilder = SledSnapshotBuilder<A>;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, Membership), StorageError<NodeId>> {
        let state = self.state.read();
        Ok((state.last_applied, state.membership.clone()))
    }

    async fn apply<I>(
        &mut self,
        entries: I,
    ) -> Result<Vec<Option<A::Response>>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = openraft::Entry<AllotRaft<A>>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut state = self.state.write();
        let mut responses = Vec::new();
        for entry in entries {
            state.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Blank => responses.push(None),
                EntryPayload::Normal(Stamped { now_ms, cmd }) => {
                    // Leaders' clocks disagree and can step back; every replica clamps the same
                    // way, so all compute the same state.
                    let now_ms = now_ms.max(state.last_stamped_ms);
                    state.last_stamped_ms = now_ms;
                    // Node-local: anchors this node's next stamps, afresh at each leader term
                    // (design §6 "Clocks"); `apply` never sees it.
                    self.time
                        .applied_in_term(now_ms, entry.log_id.leader_id.term);
                    responses.push(Some(state.app.apply(&cmd, now_ms)));
                }
                EntryPayload::Membership(membership) => {
                    state.membership = StoredMembership::new(Some(entry.log_id), membership);
                    responses.push(None);
                }
            }
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // A copy, not the encoding: openraft applies nothing until this returns, so the lock
        // is held only for the (mostly copy-on-write) copy.
        let started = std::time::Instant::now();
        let copy = self.state.read().copy();
        tracing::debug!(
            copy_us = started.elapsed().as_micros() as u64,
            last_applied = ?copy.last_applied,
            "snapshot: state copied"
        );
        SledSnapshotBuilder {
            store: self.store.clone(),
            seq: self.snapshot_seq.fetch_add(1, Ordering::Relaxed),
            copy: Some(copy),
            flush: self.flush,
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let body: SnapshotBody =
            decode(&data).map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let mut new_state = SmState::from_body(body)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        // The meta is what the leader vouches for; keep the state consistent with it.
        new_state.last_applied = meta.last_log_id;
        new_state.membership = meta.last_membership.clone();
        let (store, stored_meta) = (self.store.clone(), meta.clone());
        self.flush
            .off_runtime(move || store.store(&stored_meta, &data))
            .await
            .and_then(|r| r)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let stamp = new_state.last_stamped_ms;
        *self.state.write() = new_state;
        self.time.applied(stamp);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<AllotRaft<A>>>, StorageError<NodeId>> {
        let store = self.store.clone();
        let stored = self
            .flush
            .off_runtime(move || store.load())
            .await
            .and_then(|r| r)
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        Ok(stored.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, Entry, Membership as RaftMembership};

    use super::*;
    use crate::raft::test_app::{CounterApp, CounterCmd};
    use crate::raft::ManualNodeClock;

    fn temp_db() -> (tempfile::TempDir, sled::Db) {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::Config::new().path(dir.path()).open().expect("sled");
        (dir, db)
    }

    fn log_id(index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(1, 1), index)
    }

    fn add(index: u64, now_ms: u64, by: u64) -> Entry<AllotRaft<CounterApp>> {
        Entry {
            log_id: log_id(index),
            payload: EntryPayload::Normal(Stamped {
                now_ms,
                cmd: CounterCmd::Add {
                    key: "k".into(),
                    by,
                    ttl_ms: 1_000,
                },
            }),
        }
    }

    #[tokio::test]
    async fn apply_clamps_stamped_time_and_answers_every_entry() {
        let (_dir, db) = temp_db();
        let mut sm = SledStateMachine::<CounterApp>::open(&db, _dir.path()).expect("open");
        let membership = Entry {
            log_id: log_id(2),
            payload: EntryPayload::Membership(RaftMembership::new(
                vec![[1u64].into_iter().collect()],
                None,
            )),
        };
        let blank = Entry {
            log_id: log_id(1),
            payload: EntryPayload::Blank,
        };
        let responses = sm
            .apply([blank, membership, add(3, 5_000, 1), add(4, 4_000, 1)])
            .await
            .expect("apply");
        assert_eq!(responses.len(), 4);
        assert!(responses[0].is_none() && responses[1].is_none());
        let late = responses[3].as_ref().expect("app response");
        // The second leader's clock was 1 s behind; the state machine kept time monotonic.
        assert_eq!(late.applied_at_ms, 5_000);
        assert_eq!(late.value, 2);
        let (applied, membership) = sm.applied_state().await.expect("state");
        assert_eq!(applied, Some(log_id(4)));
        assert_eq!(membership.log_id(), &Some(log_id(2)));
        assert_eq!(sm.handle().last_stamped_ms(), 5_000);
    }

    #[tokio::test]
    async fn snapshot_is_encoded_from_a_copy_while_apply_continues() {
        let (_dir, db) = temp_db();
        let mut sm = SledStateMachine::<CounterApp>::open(&db, _dir.path()).expect("open");
        sm.apply([add(1, 100, 3)]).await.expect("apply");
        let mut builder = sm.get_snapshot_builder().await;
        // The builder holds no lock: applies go on before its (slow) encoding runs.
        assert!(
            sm.state.try_write().is_some(),
            "the builder holds the state lock"
        );
        sm.apply([add(2, 200, 4)])
            .await
            .expect("apply while building");
        let snapshot = builder.build_snapshot().await.expect("build");
        assert_eq!(snapshot.meta.last_log_id, Some(log_id(1)));
        let (_dir2, db2) = temp_db();
        let mut other = SledStateMachine::<CounterApp>::open(&db2, _dir2.path()).expect("open");
        other
            .install_snapshot(&snapshot.meta, snapshot.snapshot)
            .await
            .expect("install");
        assert_eq!(other.handle().read(|app| app.get("k", 150)), Some(3));
        assert_eq!(sm.handle().read(|app| app.get("k", 250)), Some(7));
    }

    #[tokio::test]
    async fn snapshot_survives_reopen() {
        let (dir, db) = temp_db();
        let mut sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("open");
        sm.apply([add(1, 100, 3), add(2, 200, 4)])
            .await
            .expect("apply");
        let mut builder = sm.get_snapshot_builder().await;
        let snapshot = builder.build_snapshot().await.expect("build");
        assert_eq!(snapshot.meta.last_log_id, Some(log_id(2)));
        drop((sm, builder, db));

        let db = crate::raft::node::open_db(dir.path())
            .await
            .expect("reopen");
        let mut sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("open again");
        let (applied, _) = sm.applied_state().await.expect("state");
        assert_eq!(applied, Some(log_id(2)));
        assert_eq!(sm.handle().read(|app| app.get("k", 250)), Some(7));
        assert_eq!(sm.handle().last_stamped_ms(), 200);
        let current = sm
            .get_current_snapshot()
            .await
            .expect("read")
            .expect("some");
        assert_eq!(current.meta, snapshot.meta);
    }

    #[tokio::test]
    async fn installed_snapshot_replaces_state_and_older_one_is_ignored() {
        let (_src_dir, src_db) = temp_db();
        let mut src = SledStateMachine::<CounterApp>::open(&src_db, _src_dir.path()).expect("open");
        src.apply([add(1, 100, 1)]).await.expect("apply");
        let old = build(&mut src).await;
        src.apply([add(2, 150, 1)]).await.expect("apply");
        let new = build(&mut src).await;

        let (_dst_dir, dst_db) = temp_db();
        let mut dst = SledStateMachine::<CounterApp>::open(&dst_db, _dst_dir.path()).expect("open");
        dst.install_snapshot(&new.meta, new.snapshot)
            .await
            .expect("install");
        assert_eq!(dst.handle().read(|app| app.get("k", 160)), Some(2));
        // A stale snapshot stored later (e.g. by a slow builder) must not win on disk.
        let stored = dst
            .store
            .store(&old.meta, &old.snapshot.into_inner())
            .expect("store");
        assert!(!stored, "an older snapshot is not stored over a newer one");
        let current = dst
            .get_current_snapshot()
            .await
            .expect("read")
            .expect("some");
        assert_eq!(current.meta.last_log_id, Some(log_id(2)));
    }

    /// Issue 10 item 2: the stamps a node proposes follow what it applied, restored or installed,
    /// at its own monotonic time of doing so; its wall clock alone counts only before that.
    #[tokio::test]
    async fn applied_restored_and_installed_stamps_anchor_the_next_stamp() {
        let (dir, db) = temp_db();
        let clock = ManualNodeClock::with_monotonic(1_000_000, 0);
        let mut sm = SledStateMachine::<CounterApp>::open_with_clock(
            &db,
            dir.path(),
            Arc::new(clock.clone()),
        )
        .expect("open");
        let time = sm.ledger_time();
        assert_eq!(time.stamp(), 1_000_000, "nothing applied: the wall clock");
        sm.apply([add(1, 100, 1)]).await.expect("apply");
        assert_eq!(time.stamp(), 100, "a wall clock far ahead is not followed");
        clock.advance(50);
        assert_eq!(time.stamp(), 150, "real time elapsed since the apply");
        let snapshot = build(&mut sm).await;
        drop((sm, time, db));

        // A restart: a new monotonic origin, a day of downtime on the wall clock. The restored
        // stamp anchors at load; the downtime is not counted.
        let db = crate::raft::node::open_db(dir.path())
            .await
            .expect("reopen");
        let clock = ManualNodeClock::with_monotonic(86_400_000, 7_000_000_000);
        let sm = SledStateMachine::<CounterApp>::open_with_clock(
            &db,
            dir.path(),
            Arc::new(clock.clone()),
        )
        .expect("open again");
        assert_eq!(sm.ledger_time().stamp(), 100);
        clock.advance(30);
        assert_eq!(sm.ledger_time().stamp(), 130);

        // A follower that installs the snapshot anchors it at its installation.
        let (_dir2, db2) = temp_db();
        let clock = ManualNodeClock::with_monotonic(5_000, 3);
        let mut other = SledStateMachine::<CounterApp>::open_with_clock(
            &db2,
            _dir2.path(),
            Arc::new(clock.clone()),
        )
        .expect("open");
        other
            .install_snapshot(&snapshot.meta, snapshot.snapshot)
            .await
            .expect("install");
        clock.advance(20);
        assert_eq!(other.ledger_time().stamp(), 120);
        assert_eq!(other.ledger_time().last_ms(), 100);
    }

    #[tokio::test]
    async fn corrupt_snapshot_on_disk_is_an_error_not_a_panic() {
        let (_dir, db) = temp_db();
        db.open_tree(SM_TREE)
            .expect("tree")
            .insert(KEY_SNAPSHOT, &[1u8, 2, 3][..])
            .expect("insert");
        assert!(matches!(
            SledStateMachine::<CounterApp>::open(&db, _dir.path()),
            Err(StateMachineError::Decode(_))
        ));
        let (_dir2, db2) = temp_db();
        let mut sm_err = SledStateMachine::<CounterApp>::open(&db2, _dir2.path()).expect("fresh");
        let meta = Meta {
            last_log_id: Some(log_id(1)),
            last_membership: Membership::default(),
            snapshot_id: "x".into(),
        };
        assert!(sm_err
            .install_snapshot(&meta, Box::new(Cursor::new(vec![9, 9, 9])))
            .await
            .is_err());
    }

    /// A snapshot of `sm` as it is.
    async fn build(sm: &mut SledStateMachine<CounterApp>) -> Snapshot<AllotRaft<CounterApp>> {
        let mut builder = sm.get_snapshot_builder().await;
        builder.build_snapshot().await.expect("build")
    }

    fn stored_example() -> StoredSnapshot {
        let membership = RaftMembership::new(vec![[1u64, 2].into_iter().collect()], None);
        StoredSnapshot {
            meta: Meta {
                last_log_id: Some(log_id(300)),
                last_membership: StoredMembership::new(Some(log_id(2)), membership),
                snapshot_id: "1-1-300-4".into(),
            },
            data: (0..=255u8).cycle().take(70_000).collect(),
        }
    }

    #[test]
    fn the_stored_form_is_what_bincode_gives_the_stored_snapshot() {
        for s in [
            stored_example(),
            StoredSnapshot {
                meta: Meta::default(),
                data: Vec::new(),
            },
        ] {
            let mut written = Vec::new();
            write_stored(&s.meta, &s.data, &mut written).expect("write");
            assert_eq!(written, encode(&s).expect("encode"));
            let back = read_stored(&written).expect("read");
            assert_eq!((back.meta, back.data), (s.meta, s.data));
        }
    }

    #[test]
    fn the_body_is_built_as_bincode_encodes_it() {
        let s = stored_example();
        for app in [Vec::new(), vec![5u8], s.data.clone()] {
            let body = SnapshotBody {
                last_applied: s.meta.last_log_id,
                membership: s.meta.last_membership.clone(),
                last_stamped_ms: u64::MAX,
                app: app.clone(),
            };
            let built = body_bytes(
                body.last_applied,
                &body.membership,
                body.last_stamped_ms,
                app,
            )
            .expect("build");
            assert_eq!(built, encode(&body).expect("encode"));
        }
    }

    /// bincode writes a length in one byte up to 250, else a marker and a u16, u32 or u64:
    /// the hand-built forms agree with the derived encoding on both sides of each step.
    #[test]
    fn lengths_at_each_varint_step_encode_as_bincode_does() {
        let s = stored_example();
        for len in [250usize, 251, 65_535, 65_536] {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut written = Vec::new();
            write_stored(&s.meta, &data, &mut written).expect("write");
            let derived = StoredSnapshot {
                meta: s.meta.clone(),
                data: data.clone(),
            };
            assert_eq!(written, encode(&derived).expect("encode"), "stored, {len}");
            assert_eq!(read_stored(&written).expect("read").data, data);
            let body = SnapshotBody {
                last_applied: s.meta.last_log_id,
                membership: s.meta.last_membership.clone(),
                last_stamped_ms: 250,
                app: data.clone(),
            };
            let built = body_bytes(body.last_applied, &body.membership, 250, data).expect("build");
            assert_eq!(built, encode(&body).expect("encode"), "body, {len}");
            // What a follower's install_snapshot decodes.
            let back: SnapshotBody = decode(&built).expect("decode");
            assert_eq!(back.app, body.app);
        }
    }

    #[test]
    fn a_stored_form_cut_short_or_too_long_does_not_decode() {
        let s = stored_example();
        let mut bytes = Vec::new();
        write_stored(&s.meta, &s.data, &mut bytes).expect("write");
        for cut in [0, 1, 10, bytes.len() - 1] {
            assert!(read_stored(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        bytes.push(0);
        assert!(read_stored(&bytes).is_err());
    }

    /// A node that stored its snapshot in sled (before snapshots moved to a file) restores it,
    /// and from then on has it in the file only.
    #[tokio::test]
    async fn a_snapshot_kept_in_sled_moves_to_the_file() {
        let (_src_dir, src_db) = temp_db();
        let mut src = SledStateMachine::<CounterApp>::open(&src_db, _src_dir.path()).expect("open");
        src.apply([add(1, 100, 3), add(2, 200, 4)])
            .await
            .expect("apply");
        let snap = build(&mut src).await;
        let legacy = StoredSnapshot {
            meta: snap.meta.clone(),
            data: snap.snapshot.into_inner(),
        };
        let (dir, db) = temp_db();
        let tree = db.open_tree(SM_TREE).expect("tree");
        tree.insert(KEY_SNAPSHOT, encode(&legacy).expect("encode"))
            .expect("insert");
        let mut sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("open");
        assert_eq!(sm.handle().read(|app| app.get("k", 250)), Some(7));
        assert_eq!(tree.get(KEY_SNAPSHOT).expect("get"), None);
        let current = sm
            .get_current_snapshot()
            .await
            .expect("read")
            .expect("some");
        assert_eq!(current.meta, legacy.meta);
        drop(sm);
        // Reopened: from the file alone.
        let sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("reopen");
        assert_eq!(sm.handle().read(|app| app.get("k", 250)), Some(7));
    }

    /// A crash between writing the file and removing the sled copy leaves both: the newer
    /// one wins, and the sled copy goes.
    #[tokio::test]
    async fn with_a_snapshot_in_both_places_the_newer_one_wins() {
        let (dir, db) = temp_db();
        let mut sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("open");
        sm.apply([add(1, 100, 1)]).await.expect("apply");
        let old = build(&mut sm).await;
        sm.apply([add(2, 150, 1)]).await.expect("apply");
        let new = build(&mut sm).await;
        drop(sm);
        let tree = db.open_tree(SM_TREE).expect("tree");
        let older = StoredSnapshot {
            meta: old.meta,
            data: old.snapshot.into_inner(),
        };
        tree.insert(KEY_SNAPSHOT, encode(&older).expect("encode"))
            .expect("insert");
        let sm = SledStateMachine::<CounterApp>::open(&db, dir.path()).expect("open");
        assert_eq!(sm.handle().read(|app| app.get("k", 160)), Some(2));
        assert_eq!(tree.get(KEY_SNAPSHOT).expect("get"), None);
        assert_eq!(
            sm.store.load().expect("load").map(|s| s.meta),
            Some(new.meta)
        );
    }

    #[tokio::test]
    async fn a_corrupt_snapshot_file_is_an_error_not_a_panic() {
        let (dir, db) = temp_db();
        SnapshotFile::in_dir(dir.path())
            .replace(|w| w.write_all(&[1, 2, 3]))
            .expect("write");
        assert!(matches!(
            SledStateMachine::<CounterApp>::open(&db, dir.path()),
            Err(StateMachineError::Decode(_))
        ));
    }
}
