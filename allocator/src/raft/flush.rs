//! How the sled stores make a write durable before they acknowledge it.
//!
//! Production flushes on sled's thread pool ([`Flush::Background`]) so the runtime thread never
//! blocks on `fsync`. A deterministic simulation cannot use that: the flush completes on another
//! OS thread at a moment real scheduling decides, so the simulated instant at which Raft learns
//! an entry is durable would differ from run to run. [`Flush::Inline`] flushes on the calling
//! thread instead: the write is durable when the call returns, at the same simulated instant on
//! every run (issue 12 item 1).

/// Where the sled stores run their flushes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Flush {
    /// On sled's thread pool, awaited (`flush_async`): the runtime thread stays free.
    #[default]
    Background,
    /// On the calling thread (`flush`), blocking it until the data is on disk. For simulations
    /// on simulated time; a server should not block its runtime this way.
    Inline,
}

impl Flush {
    /// Flushes `tree` (a whole database flushes through any of its trees) the chosen way;
    /// returns the bytes written, as sled does.
    ///
    /// # Errors
    /// sled's error when the flush fails.
    pub async fn run(self, tree: &sled::Tree) -> sled::Result<usize> {
        match self {
            Flush::Background => tree.flush_async().await,
            Flush::Inline => tree.flush(),
        }
    }

    /// Runs `f` (blocking file I/O, or a long computation) where this mode runs such work: on
    /// tokio's blocking pool ([`Flush::Background`]: the runtime threads stay free, and what `f`
    /// allocates for a while comes from another thread's heap than the runtime's), or at once on
    /// the calling thread ([`Flush::Inline`]: at the same simulated instant on every run).
    ///
    /// # Errors
    /// An I/O error of kind `Other` when the blocking task panicked or was cancelled.
    pub async fn off_runtime<T: Send + 'static>(
        self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<T> {
        match self {
            Flush::Background => tokio::task::spawn_blocking(f)
                .await
                .map_err(std::io::Error::other),
            Flush::Inline => Ok(f()),
        }
    }
}
