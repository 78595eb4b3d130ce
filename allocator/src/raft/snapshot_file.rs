//! The state machine's latest snapshot as a file in the node's data folder (issue 13 item 3).
//!
//! It used to be one value of sled tree `sm`, and sled keeps the values it holds in its page
//! cache (1 GiB by default): a node kept its whole encoded snapshot resident for good, 479
//! bytes per policy key with a live allocation (42 MB at 100,000 keys; measured: a value of
//! 42 MB inserted and flushed stayed in the heap), a third of the ledger's own heap. A file is
//! read only at start-up and when a follower needs the snapshot.
//!
//! Replaced atomically: the new snapshot is written to a temporary file, synced, renamed over the
//! old one, and the folder synced, so a crash leaves the old snapshot or the new one, never a mix
//! or neither.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Name of the snapshot file in the node's data folder.
/// (Not `snap.…`: sled takes files of that prefix in its folder for its own.)
pub const FILE_NAME: &str = "state-machine.snapshot";
/// Name of a snapshot being written; renamed to [`FILE_NAME`] once complete.
const PARTIAL_NAME: &str = "state-machine.snapshot.partial";

/// The snapshot file of one data folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFile {
    dir: PathBuf,
}

impl SnapshotFile {
    /// The snapshot file of data folder `dir` (which must exist before a snapshot is written).
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }

    /// Path of the snapshot file.
    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    /// The stored bytes; `None` when no snapshot was stored.
    ///
    /// # Errors
    /// The I/O error of a file that exists but cannot be read.
    pub fn read(&self) -> io::Result<Option<Vec<u8>>> {
        let mut f = match File::open(self.path()) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }

    /// Replaces the stored snapshot with the bytes `write` writes, atomically (see the module
    /// docs); durable when it returns.
    ///
    /// # Errors
    /// The I/O error of any step, or `write`'s; the stored snapshot is then unchanged.
    pub fn replace(&self, write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
        let partial = self.dir.join(PARTIAL_NAME);
        let mut out = BufWriter::new(File::create(&partial)?);
        write(&mut out)?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&partial, self.path())?;
        // The rename is durable only once the folder's entry is.
        File::open(&self.dir)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_stored_reads_as_none_and_a_replacement_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = SnapshotFile::in_dir(dir.path());
        assert_eq!(f.read().expect("read"), None);
        f.replace(|w| w.write_all(b"first")).expect("write");
        assert_eq!(f.read().expect("read").as_deref(), Some(&b"first"[..]));
        f.replace(|w| w.write_all(&[7u8; 100_000]))
            .expect("write again");
        assert_eq!(f.read().expect("read"), Some(vec![7u8; 100_000]));
        f.replace(|_| Ok(())).expect("an empty one");
        assert_eq!(f.read().expect("read"), Some(Vec::new()));
        assert!(!dir.path().join(PARTIAL_NAME).exists());
    }

    #[test]
    fn a_failed_write_leaves_the_stored_snapshot_as_it_was() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = SnapshotFile::in_dir(dir.path());
        f.replace(|w| w.write_all(b"kept")).expect("write");
        let failed = f.replace(|w| {
            w.write_all(b"half")?;
            Err(io::Error::other("encoder failed"))
        });
        assert!(failed.is_err());
        assert_eq!(f.read().expect("read").as_deref(), Some(&b"kept"[..]));
    }

    #[test]
    fn a_missing_folder_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = SnapshotFile::in_dir(&dir.path().join("gone"));
        assert_eq!(f.read().expect("read"), None);
        assert!(f.replace(|w| w.write_all(b"x")).is_err());
    }
}
