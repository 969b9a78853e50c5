//! Library log messages, delivered to one process-wide callback.

use super::boundary::ffi_call;
use super::status::ni_status;
use crate::{Error, ErrorKind};
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::sync::RwLock;

/// Severity of a log message; smaller is more severe.
pub type ni_log_level = u32;
pub const NI_LOG_ERROR: ni_log_level = 1;
pub const NI_LOG_WARN: ni_log_level = 2;
pub const NI_LOG_INFO: ni_log_level = 3;
pub const NI_LOG_DEBUG: ni_log_level = 4;

/// Receives one log message. `message` is NUL-terminated UTF-8 owned by the
/// library and valid only during the call. It may be called from any thread
/// that is inside a library call, including several threads at once. It must
/// not unwind (throw) and must not call `ni_set_log_callback`; other library
/// calls are allowed (no library lock is held while it runs).
pub type ni_log_callback = Option<
    unsafe extern "C" fn(level: ni_log_level, message: *const c_char, user_data: *mut c_void),
>;

struct Sink {
    callback: unsafe extern "C" fn(ni_log_level, *const c_char, *mut c_void),
    user_data: *mut c_void,
}

// SAFETY: the caller of `ni_set_log_callback` promises (documented there)
// that the callback and its user_data may be used from any thread.
unsafe impl Send for Sink {}
unsafe impl Sync for Sink {}

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

thread_local! {
    /// Set while this thread runs the callback: suppresses nested messages
    /// and refuses `ni_set_log_callback`, which would deadlock.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Sends `message` to the installed callback, if any.
pub(crate) fn emit(level: ni_log_level, message: &str) {
    if IN_CALLBACK.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    let sink = SINK.read().unwrap_or_else(|e| e.into_inner());
    let Some(sink) = sink.as_ref() else { return };
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    IN_CALLBACK.with(|f| f.set(true));
    // SAFETY: the callback was installed by the host with this user_data and
    // the promise that it may be called from any thread; `text` outlives the call.
    unsafe { (sink.callback)(level, text.as_ptr(), sink.user_data) };
    IN_CALLBACK.with(|f| f.set(false));
}

/// Installs the process-wide log callback (NULL removes it; without one,
/// messages are dropped). Messages: model loads and session creation (info),
/// recovery after an internal panic (warn), caught panics (error).
///
/// Lifetime: once this returns, the previous callback is not running and
/// will not be called again, so its user_data may be released.
/// Thread-safety: any thread; `callback` must tolerate being called from
/// several threads at once. Returns `NI_ERR_BUSY` when called from inside a
/// log callback.
#[no_mangle]
pub extern "C" fn ni_set_log_callback(
    callback: ni_log_callback,
    user_data: *mut c_void,
) -> ni_status {
    ffi_call("ni_set_log_callback", || {
        if IN_CALLBACK.try_with(Cell::get).unwrap_or(false) {
            return Err(Error::new(
                ErrorKind::Busy,
                "ni_set_log_callback must not be called from inside the log callback",
            ));
        }
        let mut sink = SINK.write().unwrap_or_else(|e| e.into_inner());
        *sink = callback.map(|callback| Sink {
            callback,
            user_data,
        });
        Ok(())
    })
}
