//! `ni_status`: the result of every fallible call, one code per `ErrorKind`.

use crate::ErrorKind;
use std::ffi::c_char;

/// Result of a fallible call. `NI_OK` (0) is success; on any other value
/// `ni_last_error()` describes what went wrong on this thread.
pub type ni_status = i32;

/// Success.
pub const NI_OK: ni_status = 0;
/// A caller-supplied argument is invalid (NULL pointer, bad parameter,
/// token id outside the vocabulary, invalid UTF-8, ...).
pub const NI_ERR_INVALID_ARGUMENT: ni_status = 1;
/// A file could not be read.
pub const NI_ERR_IO: ni_status = 2;
/// A model file or directory is malformed.
pub const NI_ERR_INVALID_MODEL: ni_status = 3;
/// Valid input that this build does not support (architecture, dtype, device).
pub const NI_ERR_UNSUPPORTED: ni_status = 4;
/// A memory budget or allocation could not be satisfied.
pub const NI_ERR_OUT_OF_MEMORY: ni_status = 5;
/// The operation was cancelled by the caller (e.g. a progress callback
/// returned false).
pub const NI_ERR_CANCELLED: ni_status = 6;
/// The call is not allowed in the current state (e.g. re-entering the
/// library from a callback).
pub const NI_ERR_BUSY: ni_status = 7;
/// A bug inside the library that was detected and reported.
pub const NI_ERR_INTERNAL: ni_status = 8;
/// A bug inside the library: a Rust panic was caught at the API boundary.
/// The host process is unaffected; the object the call worked on stays
/// usable when its consistency checks pass (otherwise later calls on it
/// return `NI_ERR_INTERNAL`).
pub const NI_ERR_PANIC: ni_status = 9;

/// The status code for an error kind (one-to-one).
pub(crate) fn status_for(kind: ErrorKind) -> ni_status {
    match kind {
        ErrorKind::InvalidArgument => NI_ERR_INVALID_ARGUMENT,
        ErrorKind::Io => NI_ERR_IO,
        ErrorKind::InvalidModel => NI_ERR_INVALID_MODEL,
        ErrorKind::Unsupported => NI_ERR_UNSUPPORTED,
        ErrorKind::OutOfMemory => NI_ERR_OUT_OF_MEMORY,
        ErrorKind::Cancelled => NI_ERR_CANCELLED,
        ErrorKind::Busy => NI_ERR_BUSY,
        ErrorKind::Internal => NI_ERR_INTERNAL,
    }
}

/// The constant's name of a status (`"NI_ERR_IO"`), or `"NI_ERR_UNKNOWN"`
/// for a value this library does not define.
///
/// Ownership: the string is static; never free it. Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn ni_status_name(status: ni_status) -> *const c_char {
    super::boundary::ffi_value("ni_status_name", c"NI_ERR_UNKNOWN".as_ptr(), || {
        status_name(status)
    })
}

fn status_name(status: ni_status) -> *const c_char {
    let name: &'static [u8] = match status {
        NI_OK => b"NI_OK\0",
        NI_ERR_INVALID_ARGUMENT => b"NI_ERR_INVALID_ARGUMENT\0",
        NI_ERR_IO => b"NI_ERR_IO\0",
        NI_ERR_INVALID_MODEL => b"NI_ERR_INVALID_MODEL\0",
        NI_ERR_UNSUPPORTED => b"NI_ERR_UNSUPPORTED\0",
        NI_ERR_OUT_OF_MEMORY => b"NI_ERR_OUT_OF_MEMORY\0",
        NI_ERR_CANCELLED => b"NI_ERR_CANCELLED\0",
        NI_ERR_BUSY => b"NI_ERR_BUSY\0",
        NI_ERR_INTERNAL => b"NI_ERR_INTERNAL\0",
        NI_ERR_PANIC => b"NI_ERR_PANIC\0",
        _ => b"NI_ERR_UNKNOWN\0",
    };
    name.as_ptr().cast()
}
