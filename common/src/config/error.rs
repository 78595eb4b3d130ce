//! Config errors: every one names the file; validation errors also name the field path and value.

use std::path::PathBuf;

/// Why a config was refused. Nothing is decided with a config that produced one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file or folder could not be read.
    #[error("{}: cannot read: {message}", file.display())]
    Io {
        /// The path.
        file: PathBuf,
        /// The OS error.
        message: String,
    },
    /// The text is not YAML of the expected shape (syntax error, unknown field, wrong type).
    /// The message carries the line and column.
    #[error("{}: {message}", file.display())]
    Syntax {
        /// The file.
        file: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A field has an invalid value.
    #[error("{}: {path}: {message} (got {value})", file.display())]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Field path, e.g. `descriptors[0].rate_limit.burst`.
        path: String,
        /// The value as written, or `<missing>`.
        value: String,
        /// What is wrong.
        message: String,
    },
    /// Two files define the same domain.
    #[error("domain {domain:?} is defined in both {} and {}", first.display(), second.display())]
    DuplicateDomain {
        /// The domain.
        domain: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
    /// A folder holds no `*.yaml` / `*.yml` file.
    #[error("{}: no config files (*.yaml, *.yml) in this folder", dir.display())]
    Empty {
        /// The folder.
        dir: PathBuf,
    },
}
