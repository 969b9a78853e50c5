//! The app's abort callback: stopping a running step from inside it.

use super::args;
use super::boundary::ffi_call;
use super::session::ni_session;
use super::status::ni_status;
use crate::{Error, ErrorKind, Result};
use std::cell::Cell;
use std::ffi::c_void;

/// Polled by a running `ni_session_step` within every layer of the model
/// (and before the step's forward pass); return true to abort the step.
/// Called on the thread that steps, with the `user_data` given to
/// `ni_session_set_abort_callback`. It must be fast (it runs a few times per
/// layer), must not unwind (throw), and must not call into the session it
/// belongs to except `ni_session_cancel` (other calls on that session fail
/// with `NI_ERR_BUSY`).
pub type ni_abort_callback = Option<unsafe extern "C" fn(user_data: *mut c_void) -> bool>;

thread_local! {
    /// Set while this thread runs an abort callback.
    static IN_ABORT_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Refuses session calls from inside an abort callback: the step that runs
/// the callback holds the session's lock, so waiting for it would deadlock.
pub(crate) fn refuse_inside_callback() -> Result<()> {
    if IN_ABORT_CALLBACK.with(Cell::get) {
        return Err(Error::new(
            ErrorKind::Busy,
            "called from inside the session's abort callback (only ni_session_cancel may be)",
        ));
    }
    Ok(())
}

/// The callback and its user data, callable from the stepping thread.
struct AbortCallback {
    callback: unsafe extern "C" fn(*mut c_void) -> bool,
    user_data: *mut c_void,
}

// SAFETY: the app hands the callback to the library for exactly this use:
// being called on whichever thread steps the session (documented on
// `ni_abort_callback`); `user_data` is only passed back to it.
unsafe impl Send for AbortCallback {}
// SAFETY: as for `Send`; the library never touches `user_data` itself.
unsafe impl Sync for AbortCallback {}

impl AbortCallback {
    fn poll(&self) -> bool {
        IN_ABORT_CALLBACK.with(|flag| flag.set(true));
        // SAFETY: the app installed this callback with this user data and
        // keeps both valid until it replaces or clears them (contract of
        // `ni_session_set_abort_callback`).
        let abort = unsafe { (self.callback)(self.user_data) };
        IN_ABORT_CALLBACK.with(|flag| flag.set(false));
        abort
    }
}

/// Installs `callback` (with `user_data`) as the session's abort check, or
/// removes it when `callback` is NULL. While a step runs, the callback is
/// polled within every layer; when it returns true the step stops at once
/// and `ni_session_step` fails with `NI_ERR_CANCELLED`: no request advanced,
/// and the events that step had gathered (e.g. of requests cancelled
/// before it) are delivered by the next successful step. Stepping again
/// redoes the same work, so return true only until the app has decided
/// (e.g. cancelled requests or stopped stepping). The latency from the
/// callback's true to the step's return is a fraction of one layer's time.
///
/// `user_data` must stay valid until the callback is replaced or cleared,
/// or the session is freed.
/// Thread-safety: any thread; serialized with other calls on this session
/// (it waits for a running `ni_session_step`).
#[no_mangle]
pub unsafe extern "C" fn ni_session_set_abort_callback(
    session: *mut ni_session,
    callback: ni_abort_callback,
    user_data: *mut c_void,
) -> ni_status {
    ffi_call("ni_session_set_abort_callback", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        let check = callback.map(|callback| {
            let cb = AbortCallback {
                callback,
                user_data,
            };
            Box::new(move || cb.poll()) as crate::engine::AbortCheck
        });
        s.lock()?.session.set_abort_check(check);
        Ok(())
    })
}
