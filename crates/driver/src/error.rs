//! Errors of the driver. Every error has a kind a caller can branch on, and the kind maps to
//! an errno so that a C API can be put on top later. Completions carry only the kind (no
//! allocation on the I/O path); setup and submission errors also carry a message with the
//! numbers.

use std::fmt;
use std::io;

/// What went wrong, coarsely.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum ErrorKind {
    /// A bad argument: misaligned offset or length, empty buffer, bad option.
    InvalidInput,
    /// A sector range past the end of the disk.
    OutOfRange,
    /// A write-type request to a read-only disk.
    ReadOnly,
    /// The device does not offer this request (or answered UNSUPP).
    Unsupported,
    /// The device answered IOERR.
    Io,
    /// The device went away; the request was not (or not known to be) carried out.
    Disconnected,
    /// The device broke the virtio or vhost-user protocol.
    Protocol,
    /// Shared memory could not be made or is exhausted.
    Memory,
    /// The socket could not be reached or the handshake failed.
    Connect,
    /// A wait ran out of time.
    Timeout,
}

impl ErrorKind {
    /// The errno this kind corresponds to.
    pub fn errno(self) -> i32 {
        match self {
            ErrorKind::InvalidInput => libc::EINVAL,
            ErrorKind::OutOfRange => libc::ERANGE,
            ErrorKind::ReadOnly => libc::EROFS,
            ErrorKind::Unsupported => libc::EOPNOTSUPP,
            ErrorKind::Io => libc::EIO,
            ErrorKind::Disconnected => libc::ENOTCONN,
            ErrorKind::Protocol => libc::EPROTO,
            ErrorKind::Memory => libc::ENOMEM,
            ErrorKind::Connect => libc::ECONNREFUSED,
            ErrorKind::Timeout => libc::ETIMEDOUT,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid argument",
            ErrorKind::OutOfRange => "out of range",
            ErrorKind::ReadOnly => "the disk is read-only",
            ErrorKind::Unsupported => "not supported by the device",
            ErrorKind::Io => "I/O error reported by the device",
            ErrorKind::Disconnected => "the device disconnected",
            ErrorKind::Protocol => "the device broke the protocol",
            ErrorKind::Memory => "shared memory",
            ErrorKind::Connect => "cannot attach to the device",
            ErrorKind::Timeout => "timed out",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

impl std::error::Error for ErrorKind {}

/// An error with its kind, a message naming the numbers, and the OS error behind it.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
    source: Option<io::Error>,
}

impl Error {
    /// An error of `kind` with message `msg`.
    pub fn new(kind: ErrorKind, msg: String) -> Error {
        Error {
            kind,
            msg,
            source: None,
        }
    }

    /// An error caused by an OS error.
    pub fn os(kind: ErrorKind, what: &str, source: io::Error) -> Error {
        Error {
            kind,
            msg: what.to_string(),
            source: Some(source),
        }
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The errno (the OS error's, if there was one).
    pub fn errno(&self) -> i32 {
        self.source
            .as_ref()
            .and_then(|e| e.raw_os_error())
            .unwrap_or_else(|| self.kind.errno())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(e) => write!(f, "{}: {e}", self.msg),
            None => f.write_str(&self.msg),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Error {
        Error::new(kind, kind.describe().to_string())
    }
}
