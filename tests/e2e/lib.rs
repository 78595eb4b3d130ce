//! Support for the end-to-end tests: where the binaries under test are.

use std::path::PathBuf;

/// Folder of `allot-allocator` and `allot-agent`: `ALLOT_BIN_DIR`, else the profile folder this
/// test binary was built into (`target/<profile>`).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ALLOT_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // target/<profile>/deps/e2e-<hash>
    exe.parent()
        .and_then(|p| p.parent())
        .map(PathBuf::from)
        .unwrap_or_default()
}
