//! What an Allot daemon (agent, allocator node, a benchmark's stand-in server) does as a process,
//! off the decision path: announce where it listens through a ready file, and wait for the
//! signal that stops it. One home, so every launcher can rely on the same behaviour.

use std::path::Path;

/// Writes `text` (lines of "NAME HOST:PORT") to `path` through a temporary file and a rename,
/// so a launcher polling for the file sees all of it or nothing, never half of it.
///
/// # Errors
/// The I/O error of writing the temporary file or renaming it.
pub fn write_ready_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// A stop signal could not be watched.
#[cfg(feature = "signal")]
#[derive(Debug, thiserror::Error)]
#[error("cannot watch {signal}")]
pub struct SignalError {
    /// The signal's name, e.g. "SIGTERM".
    pub signal: &'static str,
    /// Why the handler could not be installed.
    #[source]
    pub source: std::io::Error,
}

/// Resolves on the first SIGINT or SIGTERM: the daemon's cue to stop gracefully. Both handlers
/// are installed before it waits, so a signal that arrives from then on is not missed.
///
/// # Errors
/// [`SignalError`] when a handler cannot be installed.
#[cfg(feature = "signal")]
pub async fn stop_signal() -> Result<(), SignalError> {
    use tokio::signal::unix::{signal, SignalKind};
    let watch = |kind: SignalKind, name: &'static str| {
        signal(kind).map_err(|source| SignalError {
            signal: name,
            source,
        })
    };
    let mut term = watch(SignalKind::terminate(), "SIGTERM")?;
    let mut int = watch(SignalKind::interrupt(), "SIGINT")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::write_ready_file;

    #[test]
    fn the_ready_file_is_written_whole_and_no_temporary_is_left() {
        let dir = std::env::temp_dir().join(format!("allot-ready-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("node.ready");
        write_ready_file(&path, "grpc 127.0.0.1:1\n").expect("write");
        write_ready_file(&path, "grpc 127.0.0.1:2\n").expect("overwrite");
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            "grpc 127.0.0.1:2\n"
        );
        assert!(!dir.join("node.ready.tmp").exists());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
