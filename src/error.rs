//! One error type for the whole crate. The `kind` maps one-to-one onto the
//! C ABI's `ni_status`; the message names what was wrong.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A caller-supplied argument is invalid (bad parameter, bad token id, ...).
    InvalidArgument,
    /// A file could not be read or written.
    Io,
    /// A model file or directory is malformed (bad header, shape mismatch, ...).
    InvalidModel,
    /// Valid input that this build does not support (architecture, dtype, device).
    Unsupported,
    /// A memory budget or allocation could not be satisfied.
    OutOfMemory,
    /// The operation was cancelled by the caller (e.g. a progress callback).
    Cancelled,
    /// The object is in use by another thread.
    Busy,
    /// A bug inside the library (including a caught panic).
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }
    pub fn invalid_arg(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    pub fn invalid_model(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidModel, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("{context}: {err}"))
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an `InvalidArgument` error built from a format string.
#[macro_export]
macro_rules! bail_arg {
    ($($t:tt)*) => { return Err($crate::Error::invalid_arg(format!($($t)*))) };
}

/// Returns early with an `InvalidModel` error built from a format string.
#[macro_export]
macro_rules! bail_model {
    ($($t:tt)*) => { return Err($crate::Error::invalid_model(format!($($t)*))) };
}
