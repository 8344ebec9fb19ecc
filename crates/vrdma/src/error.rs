//! The crate's error type and its mapping onto `errno` values.

use std::fmt;
use std::io;

use vrdma_shm::{RingError, SegmentError};

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Why a vRDMA call failed.
///
/// Every error has an `errno` ([`Error::errno`]) with the meaning
/// rdma-core gives it for the same mistake, so that a C shim can pass it
/// through unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed (the control socket, a mapping, an eventfd).
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The daemon refused the request.
    #[error("vrdmad refused the request: {message} (errno {errno})")]
    Daemon {
        /// The errno the daemon chose (`EINVAL`, `ENOMEM`, `EBUSY`, ...).
        errno: i32,
        /// The daemon's explanation.
        message: String,
    },
    /// The daemon answered with something this library cannot use: a
    /// malformed or unexpected reply, missing descriptors, bad ring shapes.
    #[error("control protocol error: {0}")]
    Protocol(String),
    /// An argument was refused before anything was sent to the daemon.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A work queue (send, receive or SRQ ring) has no free slot.
    #[error("work queue full")]
    QueueFull,
    /// A shared ring's indices are inconsistent: the daemon wrote garbage
    /// or the mapping was damaged.
    #[error("shared ring corrupt: {0}")]
    Ring(#[from] RingError),
    /// The operation is valid verbs but this library or device lacks it.
    #[error("not supported: {0}")]
    Unsupported(String),
}

impl Error {
    /// The `errno` a verbs call returns for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            Error::Daemon { errno, .. } => *errno,
            Error::Protocol(_) => libc::EPROTO,
            Error::InvalidArgument(_) => libc::EINVAL,
            Error::QueueFull => libc::ENOMEM,
            Error::Ring(_) => libc::EIO,
            Error::Unsupported(_) => libc::EOPNOTSUPP,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    pub(crate) fn protocol(msg: impl Into<String>) -> Error {
        Error::Protocol(msg.into())
    }
}

impl From<SegmentError> for Error {
    fn from(e: SegmentError) -> Error {
        match e {
            SegmentError::Io(e) => Error::Io(e),
            other => Error::Protocol(format!("daemon segment unusable: {other}")),
        }
    }
}

/// A failed `post_send`/`post_recv`: which work request failed, and why.
///
/// As with `ibv_post_send`'s `bad_wr`, the requests before `index` were
/// posted and will complete; `index` and those after it were not posted.
#[derive(Debug)]
pub struct PostError {
    /// Index in the posted slice of the first work request not posted.
    pub index: usize,
    /// Why it was not posted: `InvalidArgument` (`EINVAL`) for a request
    /// the queue cannot take, `QueueFull` (`ENOMEM`) for a full ring.
    pub error: Error,
}

impl PostError {
    pub(crate) fn new(index: usize, error: Error) -> PostError {
        PostError { index, error }
    }

    /// The errno of [`error`](PostError::error).
    pub fn errno(&self) -> i32 {
        self.error.errno()
    }
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "work request {} not posted: {}", self.index, self.error)
    }
}

impl std::error::Error for PostError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Keeps the cause and drops the index, so `?` works in functions that
/// return [`Result`].
impl From<PostError> for Error {
    fn from(e: PostError) -> Error {
        e.error
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        match e {
            Error::Io(e) => e,
            other => io::Error::from_raw_os_error(other.errno()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping() {
        let io = Error::Io(io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert_eq!(io.errno(), libc::ECONNREFUSED);
        assert_eq!(Error::Io(io::Error::other("x")).errno(), libc::EIO);
        let d = Error::Daemon { errno: libc::EBUSY, message: "in use".into() };
        assert_eq!(d.errno(), libc::EBUSY);
        assert!(d.to_string().contains("in use"));
        assert_eq!(Error::protocol("x").errno(), libc::EPROTO);
        assert_eq!(Error::invalid("x").errno(), libc::EINVAL);
        assert_eq!(Error::QueueFull.errno(), libc::ENOMEM);
        assert_eq!(Error::Ring(RingError::BadStride).errno(), libc::EIO);
        assert_eq!(Error::Unsupported("x".into()).errno(), libc::EOPNOTSUPP);
    }

    #[test]
    fn post_error() {
        let p = PostError::new(3, Error::QueueFull);
        assert_eq!(p.errno(), libc::ENOMEM);
        assert!(p.to_string().starts_with("work request 3 not posted"));
        let e: Error = p.into();
        assert!(matches!(e, Error::QueueFull));
    }

    #[test]
    fn conversions() {
        let e: Error = SegmentError::NotSealed.into();
        assert!(matches!(e, Error::Protocol(_)));
        let e: Error = SegmentError::Io(io::Error::from_raw_os_error(libc::ENOMEM)).into();
        assert_eq!(e.errno(), libc::ENOMEM);
        let io: io::Error = Error::invalid("bad").into();
        assert_eq!(io.raw_os_error(), Some(libc::EINVAL));
    }
}
