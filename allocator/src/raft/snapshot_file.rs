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
        let mut out = BufWriter::new(PacedWriter::new(File::create(&partial)?));
        write(&mut out)?;
        let paced = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        let file = paced.finish()?;
        file.sync_all()?;
        drop(file);
        fs::rename(&partial, self.path())?;
        // The rename is durable only once the folder's entry is.
        File::open(&self.dir)?.sync_all()
    }
}

/// Bytes of a snapshot written back to disk at a time ([`PacedWriter`]).
pub const WRITEBACK_CHUNK: u64 = 1 << 20;

/// A file writer that has the kernel write each [`WRITEBACK_CHUNK`] to disk before it takes
/// more (Linux `sync_file_range`, as RocksDB's `bytes_per_sync`), so that the final `fsync`
/// finds little left to write. A snapshot is tens of MB written at memory speed; flushed in one
/// piece it filled the disk's queue in front of the Raft log's own small `fsync`s, and every
/// commit on the node waited for it (the cluster bench's calls stalled ~100 ms at each
/// snapshot). Elsewhere than Linux it only writes.
struct PacedWriter {
    file: File,
    written: u64,
    synced: u64,
}

impl PacedWriter {
    fn new(file: File) -> Self {
        Self {
            file,
            written: 0,
            synced: 0,
        }
    }

    /// Writes back what was written since the last chunk and waits for it.
    fn write_back(&mut self) -> io::Result<()> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let len = self.written - self.synced;
            let (Ok(offset), Ok(len)) = (
                libc::off64_t::try_from(self.synced),
                libc::off64_t::try_from(len),
            ) else {
                return Err(io::Error::other("snapshot larger than a file offset"));
            };
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            // SAFETY: the descriptor is this writer's open file; the call takes no pointer.
            if unsafe { libc::sync_file_range(self.file.as_raw_fd(), offset, len, flags) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        self.synced = self.written;
        Ok(())
    }

    /// The file, everything written handed to the kernel (not yet synced).
    fn finish(mut self) -> io::Result<File> {
        self.file.flush()?;
        Ok(self.file)
    }
}

impl Write for PacedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // A full chunk is written back before more is taken, so that an error is reported for
        // a call that wrote nothing (the last chunk is left to the final fsync).
        if self.written - self.synced >= WRITEBACK_CHUNK {
            self.write_back()?;
        }
        // At most up to the chunk's end: a large buffer goes through in several calls.
        let room = WRITEBACK_CHUNK - (self.written - self.synced);
        let take = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.file.write(&buf[..take])?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
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

    /// Several write-back chunks, reached by one large write and by many small ones, with a
    /// tail shorter than a chunk: the file holds exactly the bytes written, in order.
    #[test]
    fn a_snapshot_of_several_chunks_reads_back_byte_for_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = SnapshotFile::in_dir(dir.path());
        let chunk = WRITEBACK_CHUNK as usize;
        let big: Vec<u8> = (0..2 * chunk + 12_345).map(|i| (i % 251) as u8).collect();
        f.replace(|w| w.write_all(&big)).expect("one large write");
        assert!(f.read().expect("read") == Some(big.clone()));
        f.replace(|w| {
            for piece in big.chunks(1_000) {
                w.write_all(piece)?;
            }
            Ok(())
        })
        .expect("many small writes");
        assert!(f.read().expect("read") == Some(big));
        let mut paced = PacedWriter::new(File::create(dir.path().join("p")).expect("create"));
        paced.write_all(&[1u8; 3 * (1 << 20) + 1]).expect("write");
        assert_eq!(paced.written, 3 * WRITEBACK_CHUNK + 1);
        assert_eq!(
            paced.synced,
            3 * WRITEBACK_CHUNK,
            "written back chunk by chunk"
        );
        paced.write_all(&[2u8; 10]).expect("write");
        assert_eq!(
            paced.synced,
            3 * WRITEBACK_CHUNK,
            "a part chunk waits for the fsync"
        );
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
