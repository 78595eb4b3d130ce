//! The replicated application seen by the Raft layer.

/// Why an application snapshot could not be restored.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AppError {
    /// The snapshot bytes do not decode into the application's state (truncated, corrupt, or
    /// written by an incompatible version).
    #[error("application snapshot does not decode: {0}")]
    CorruptSnapshot(String),
}

/// The replicated application. `now_ms` is the leader-stamped time carried in the log entry.
///
/// Every replica applies the same commands with the same stamped times in the same order, so
/// `apply` must be deterministic: no wall clock, no randomness, no iteration over unordered maps
/// whose order could differ between processes.
///
/// `Clone` lets a snapshot be taken as a copy under the state lock and encoded outside it.
pub trait App: Default + Clone + Send + Sync + 'static {
    /// A state-changing command, carried in a Raft log entry.
    type Command: serde::Serialize
        + serde::de::DeserializeOwned
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static;
    /// The result of applying a command, returned to the proposer after commit.
    type Response: serde::Serialize
        + serde::de::DeserializeOwned
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + 'static;

    /// Applies `cmd` at `stamped_now_ms` (Unix milliseconds, stamped by the leader when it
    /// proposed the entry, never smaller than the time of the previous entry and never further
    /// from it than the real time elapsed, as far as the leader could measure: see
    /// [`super::ledger_time`]). Rejections are
    /// part of `Response`: apply itself cannot fail.
    fn apply(&mut self, cmd: &Self::Command, stamped_now_ms: u64) -> Self::Response;

    /// Serialises the whole state (bincode 2) for a Raft snapshot.
    fn snapshot(&self) -> Vec<u8>;

    /// A copy from which [`App::snapshot`] gives the same bytes as from `self`, taken while
    /// the state machine applies nothing (`get_snapshot_builder`): it should be cheap, since
    /// every apply waits for it, and may leave out what its encoding can rebuild. Only
    /// [`App::into_snapshot`] (or `snapshot`) is called on it. The default is a clone.
    fn snapshot_copy(&self) -> Self {
        self.clone()
    }

    /// [`App::snapshot`]'s bytes, consuming the state: what the state machine calls on a
    /// [`App::snapshot_copy`], off its lock and off the runtime's threads, so that what the
    /// copy left out is rebuilt there without another copy. The default encodes `self`.
    fn into_snapshot(self) -> Vec<u8>
    where
        Self: Sized,
    {
        self.snapshot()
    }

    /// Rebuilds the state from [`App::snapshot`] bytes.
    ///
    /// # Errors
    /// [`AppError::CorruptSnapshot`] when the bytes do not decode.
    fn restore(bytes: &[u8]) -> Result<Self, AppError>
    where
        Self: Sized;
}
