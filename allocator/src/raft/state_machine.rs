//! The Raft state machine: the [`App`] plus Raft's bookkeeping, with snapshots in sled.
//!
//! Durability: the state machine's durable form is its latest snapshot, kept in sled tree `sm`.
//! `apply` only changes memory; on start the node restores the snapshot and openraft re-applies
//! the committed entries after it from the log (the log store persists the committed log id).
//! This avoids rewriting the whole application state on every entry.

// openraft's storage traits return `StorageError` by value; the helpers here return the same
// type so `?` composes without boxing.
#![allow(clippy::result_large_err)]

use std::io::Cursor;
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
use super::codec::{decode, encode};
use super::flush::Flush;
use super::ledger_time::LedgerTime;
use super::node_clock::{NodeClock, SystemNodeClock};
use super::types::{AllotRaft, NodeId, Stamped};

/// Name of the sled tree holding the state machine's snapshot.
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

/// A snapshot as stored in sled.
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
    /// The stored snapshot does not decode.
    #[error("stored snapshot does not decode: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    /// The application rejected the stored snapshot.
    #[error(transparent)]
    App(#[from] AppError),
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

/// The state machine of application `A`, with its snapshot persisted in sled tree [`SM_TREE`].
pub struct SledStateMachine<A> {
    tree: sled::Tree,
    state: Arc<RwLock<SmState<A>>>,
    /// Serialises "compare with the stored snapshot, then replace it" between the snapshot
    /// builder task and snapshot installation, so an older snapshot never overwrites a newer one.
    store_lock: Arc<Mutex<()>>,
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
    pub fn open(db: &sled::Db) -> Result<Self, StateMachineError> {
        Self::open_with_clock(db, Arc::new(SystemNodeClock))
    }

    /// Opens the state machine in `db`, restoring it from the stored snapshot if there is one.
    /// `clock`'s monotonic time anchors the stamps it applies (see [`Self::ledger_time`]); the
    /// restored snapshot's last stamp is anchored at the moment of loading.
    ///
    /// # Errors
    /// [`StateMachineError`] when the tree cannot be read or the stored snapshot does not decode
    /// or restore.
    pub fn open_with_clock(
        db: &sled::Db,
        clock: Arc<dyn NodeClock>,
    ) -> Result<Self, StateMachineError> {
        let tree = db.open_tree(SM_TREE)?;
        let state = match tree.get(KEY_SNAPSHOT)? {
            Some(bytes) => {
                let stored: StoredSnapshot = decode(&bytes)?;
                let body: SnapshotBody = decode(&stored.data)?;
                SmState::from_body(body)?
            }
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
            tree,
            state: Arc::new(RwLock::new(state)),
            store_lock: Arc::new(Mutex::new(())),
            snapshot_seq: Arc::new(AtomicU64::new(0)),
            time,
            flush: Flush::default(),
        })
    }

    /// The same state machine flushing snapshots the `flush` way ([`Flush::Background`] unless
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

/// Stores `stored` unless a snapshot of a later log id is already stored.
fn store_snapshot(
    tree: &sled::Tree,
    lock: &Mutex<()>,
    stored: &StoredSnapshot,
) -> Result<(), StorageError<NodeId>> {
    let signature = stored.meta.signature();
    let io_err = |e: &dyn std::error::Error| {
        StorageIOError::write_snapshot(Some(signature.clone()), openraft::AnyError::error(e))
    };
    let _guard = lock.lock();
    if let Some(bytes) = tree.get(KEY_SNAPSHOT).map_err(|e| io_err(&e))? {
        // An undecodable stored snapshot is replaced rather than trusted.
        if let Ok(current) = decode::<StoredSnapshot>(&bytes) {
            if current.meta.last_log_id > stored.meta.last_log_id {
                return Ok(());
            }
        }
    }
    let bytes = encode(stored).map_err(|e| io_err(&e))?;
    tree.insert(KEY_SNAPSHOT, bytes).map_err(|e| io_err(&e))?;
    Ok(())
}

/// Returns the allocator's free memory to the system (glibc keeps freed pages of its arenas
/// otherwise; elsewhere a no-op).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it touches
    // no memory in use and takes no pointer.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Builds snapshots from a copy of the state taken when the builder was created. The copy is a
/// clone taken under the state lock; the encoding, the slow part, runs in
/// [`RaftSnapshotBuilder::build_snapshot`] without the lock, so `apply` never waits for it
/// (issue 10 item 1).
pub struct SledSnapshotBuilder<A> {
    tree: sled::Tree,
    store_lock: Arc<Mutex<()>>,
    seq: u64,
    last_applied: Option<LogId<NodeId>>,
    membership: Membership,
    last_stamped_ms: u64,
    app: A,
    flush: Flush,
}

impl<A: App> RaftSnapshotBuilder<AllotRaft<A>> for SledSnapshotBuilder<A> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<AllotRaft<A>>, StorageError<NodeId>> {
        let snapshot_id = match self.last_applied {
            Some(id) => format!("{}-{}-{}", id.leader_id, id.index, self.seq),
            None => format!("none-{}", self.seq),
        };
        let meta = Meta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id,
        };
        let body = SnapshotBody {
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            last_stamped_ms: self.last_stamped_ms,
            app: self.app.snapshot(),
        };
        let data = encode(&body)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        // The copy is encoded: free it now, not when openraft drops the builder.
        drop(body);
        self.app = A::default();
        let stored = StoredSnapshot { meta, data };
        store_snapshot(&self.tree, &self.store_lock, &stored)?;
        // The copy was as large as the state: hand its pages back to the system, or the
        // process keeps the peak of two states as resident memory (issue 13 item 3).
        release_free_memory();
        self.flush
            .run(&self.tree)
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(stored.meta.signature()), &e))?;
        Ok(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        })
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
        let state = self.state.read();
        SledSnapshotBuilder {
            tree: self.tree.clone(),
            store_lock: self.store_lock.clone(),
            seq: self.snapshot_seq.fetch_add(1, Ordering::Relaxed),
            last_applied: state.last_applied,
            membership: state.membership.clone(),
            last_stamped_ms: state.last_stamped_ms,
            // A copy, not the encoding: the lock is held only for the clone.
            app: state.app.clone(),
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
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        store_snapshot(&self.tree, &self.store_lock, &stored)?;
        self.flush
            .run(&self.tree)
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let stamp = new_state.last_stamped_ms;
        *self.state.write() = new_state;
        self.time.applied(stamp);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<AllotRaft<A>>>, StorageError<NodeId>> {
        let bytes = self
            .tree
            .get(KEY_SNAPSHOT)
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        let Some(bytes) = bytes else {
            return Ok(None);
        };
        let stored: StoredSnapshot =
            decode(&bytes).map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
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
        let mut sm = SledStateMachine::<CounterApp>::open(&db).expect("open");
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
        let mut sm = SledStateMachine::<CounterApp>::open(&db).expect("open");
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
        let mut other = SledStateMachine::<CounterApp>::open(&db2).expect("open");
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
        let mut sm = SledStateMachine::<CounterApp>::open(&db).expect("open");
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
        let mut sm = SledStateMachine::<CounterApp>::open(&db).expect("open again");
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
        let mut src = SledStateMachine::<CounterApp>::open(&src_db).expect("open");
        src.apply([add(1, 100, 1)]).await.expect("apply");
        let old = src
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .expect("old");
        src.apply([add(2, 150, 1)]).await.expect("apply");
        let new = src
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .expect("new");

        let (_dst_dir, dst_db) = temp_db();
        let mut dst = SledStateMachine::<CounterApp>::open(&dst_db).expect("open");
        dst.install_snapshot(&new.meta, new.snapshot)
            .await
            .expect("install");
        assert_eq!(dst.handle().read(|app| app.get("k", 160)), Some(2));
        // A stale snapshot stored later (e.g. by a slow builder) must not win on disk.
        let stale = StoredSnapshot {
            meta: old.meta.clone(),
            data: old.snapshot.into_inner(),
        };
        store_snapshot(&dst.tree, &dst.store_lock, &stale).expect("store");
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
        let mut sm = SledStateMachine::<CounterApp>::open_with_clock(&db, Arc::new(clock.clone()))
            .expect("open");
        let time = sm.ledger_time();
        assert_eq!(time.stamp(), 1_000_000, "nothing applied: the wall clock");
        sm.apply([add(1, 100, 1)]).await.expect("apply");
        assert_eq!(time.stamp(), 100, "a wall clock far ahead is not followed");
        clock.advance(50);
        assert_eq!(time.stamp(), 150, "real time elapsed since the apply");
        let snapshot = sm
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .expect("build");
        drop((sm, time, db));

        // A restart: a new monotonic origin, a day of downtime on the wall clock. The restored
        // stamp anchors at load; the downtime is not counted.
        let db = crate::raft::node::open_db(dir.path())
            .await
            .expect("reopen");
        let clock = ManualNodeClock::with_monotonic(86_400_000, 7_000_000_000);
        let sm = SledStateMachine::<CounterApp>::open_with_clock(&db, Arc::new(clock.clone()))
            .expect("open again");
        assert_eq!(sm.ledger_time().stamp(), 100);
        clock.advance(30);
        assert_eq!(sm.ledger_time().stamp(), 130);

        // A follower that installs the snapshot anchors it at its installation.
        let (_dir2, db2) = temp_db();
        let clock = ManualNodeClock::with_monotonic(5_000, 3);
        let mut other =
            SledStateMachine::<CounterApp>::open_with_clock(&db2, Arc::new(clock.clone()))
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
            SledStateMachine::<CounterApp>::open(&db),
            Err(StateMachineError::Decode(_))
        ));
        let (_dir2, db2) = temp_db();
        let mut sm_err = SledStateMachine::<CounterApp>::open(&db2).expect("fresh");
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
}
