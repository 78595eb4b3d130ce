//! openraft's storage conformance suite on the sled store.

use allot_allocator::raft::test_app::CounterApp;
use allot_allocator::raft::{AllotRaft, SledLogStore, SledStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{StorageError, StorageIOError};
use tempfile::TempDir;

type C = AllotRaft<CounterApp>;

/// Builds each store in a fresh sled database inside a temporary directory that lives as long
/// as the store (the guard).
struct SledBuilder;

impl StoreBuilder<C, SledLogStore<C>, SledStateMachine<CounterApp>, TempDir> for SledBuilder {
    async fn build(
        &self,
    ) -> Result<(TempDir, SledLogStore<C>, SledStateMachine<CounterApp>), StorageError<u64>> {
        let dir = tempfile::tempdir().map_err(|e| StorageIOError::write(&e))?;
        let db = sled::Config::new()
            .path(dir.path())
            .open()
            .map_err(|e| StorageIOError::write(&e))?;
        let log = SledLogStore::open(&db).map_err(|e| StorageIOError::write(&e))?;
        let sm = SledStateMachine::open(&db, dir.path()).map_err(|e| StorageIOError::write(&e))?;
        Ok((dir, log, sm))
    }
}

#[test]
fn sled_store_passes_openraft_suite() {
    if let Err(e) = Suite::test_all(SledBuilder) {
        panic!("openraft storage suite failed on sled: {e}");
    }
}
