//! The crate's error: which step failed, and what the host tool or the
//! guest's console said.

use std::path::Path;

/// Why building an image or running a guest failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or process operation on the host failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A host tool (apt-get, dpkg-deb, ldd, strip) ran and failed.
    #[error("{command} failed ({status}): {stderr}")]
    Tool { command: String, status: String, stderr: String },
    /// An input does not make sense (a region size QEMU rejects, a missing
    /// program, a kernel package without the expected files).
    #[error("{0}")]
    Invalid(String),
    /// The guest did not reach its shell.
    #[error("the guest did not reach its shell ({why}); its console:\n{console}")]
    Boot { why: String, console: String },
    /// A command in the guest did not finish in time.
    /// `console`: the serial console's end and QEMU's stderr (a kernel
    /// message, a QEMU error), to tell a wedged guest from a slow command.
    #[error(
        "`{command}` did not finish in the guest within {secs} s; its output so far:\n{output}\n-- the \
         console's end:\n{console}"
    )]
    Timeout { command: String, secs: u64, output: String, console: String },
    /// QEMU exited (or its console closed) while a command ran.
    #[error("the guest is gone ({why}); its console's end:\n{console}")]
    Gone { why: String, console: String },
    /// A QEMU's QMP failed or answered otherwise than expected.
    #[error(transparent)]
    Qmp(#[from] crate::qmp::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io { what: what.into(), source }
    }

    pub(crate) fn path(verb: &str, path: &Path, source: std::io::Error) -> Error {
        Error::Io { what: format!("{verb} {}", path.display()), source }
    }
}
