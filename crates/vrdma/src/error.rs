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
    /// A system call failed (the control socket, a mapping, a doorbell).
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The control socket could not be connected.
    #[error("cannot connect to vrdmad at {}: {source}", path.display())]
    Connect {
        /// The socket path tried.
        path: std::path::PathBuf,
        /// Why `connect` failed (`ENOENT`: no daemon; `EACCES`: not allowed).
        source: io::Error,
    },
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
            Error::Io(e) | Error::Connect { source: e, .. } => io_errno(e),
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

/// The errno of an I/O error: its OS code, or one matching its kind.
fn io_errno(e: &io::Error) -> i32 {
    if let Some(code) = e.raw_os_error() {
        return code;
    }
    use io::ErrorKind as K;
    match e.kind() {
        K::NotFound => libc::ENOENT,
        K::PermissionDenied => libc::EACCES,
        K::ConnectionRefused => libc::ECONNREFUSED,
        K::ConnectionReset => libc::ECONNRESET,
        K::ConnectionAborted => libc::ECONNABORTED,
        K::NotConnected => libc::ENOTCONN,
        K::BrokenPipe => libc::EPIPE,
        K::WouldBlock => libc::EAGAIN,
        K::InvalidInput => libc::EINVAL,
        K::TimedOut => libc::ETIMEDOUT,
        K::Interrupted => libc::EINTR,
        K::OutOfMemory => libc::ENOMEM,
        _ => libc::EIO,
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(e: rustix::io::Errno) -> Error {
        Error::Io(e.into())
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
            Error::Connect { source, .. } => source,
            // Keep the message; the kind follows the errno.
            other => io::Error::new(io::Error::from_raw_os_error(other.errno()).kind(), other),
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
        let kind = Error::Io(io::Error::new(io::ErrorKind::NotConnected, "gone"));
        assert_eq!(kind.errno(), libc::ENOTCONN);
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
        assert_eq!(io.kind(), io::ErrorKind::InvalidInput);
        assert!(io.to_string().contains("bad"));
        let io: io::Error = Error::Io(io::Error::from_raw_os_error(libc::EPIPE)).into();
        assert_eq!(io.raw_os_error(), Some(libc::EPIPE));
    }
}
