//! The panic boundary every exported function runs in, and the thread-local
//! last-error message.

use super::log::{emit, NI_LOG_ERROR};
use super::status::{ni_status, status_for, NI_ERR_PANIC, NI_OK};
use crate::Result;
use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // During thread teardown the slot may be gone; the message is then lost.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = c);
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "non-string panic payload"
    }
}

fn report_panic(function: &str, payload: &(dyn Any + Send)) {
    let msg = format!(
        "internal error: panic in {function}: {}",
        panic_message(payload)
    );
    set_last_error(&msg);
    emit(NI_LOG_ERROR, &msg);
}

/// Runs the body of exported function `function`: an `Err` becomes its
/// status and the thread's last error; a panic becomes `NI_ERR_PANIC`.
pub(crate) fn ffi_call(function: &str, body: impl FnOnce() -> Result<()>) -> ni_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => NI_OK,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            status_for(e.kind)
        }
        Err(payload) => {
            report_panic(function, &*payload);
            NI_ERR_PANIC
        }
    }
}

/// Like `ffi_call` for functions without a status: a panic yields `fallback`.
pub(crate) fn ffi_value<T>(function: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            report_panic(function, &*payload);
            fallback
        }
    }
}

/// The message of the last failed call on the calling thread, or `""` when
/// no call has failed on it yet. Successful calls leave it unchanged, so read
/// it right after a call returned a status other than `NI_OK`.
///
/// Ownership: owned by the library; valid until the next failing call on the
/// same thread. Copy it to keep it; never free it. Never NULL.
/// Thread-safety: any thread; each thread has its own message.
#[no_mangle]
pub extern "C" fn ni_last_error() -> *const c_char {
    ffi_value("ni_last_error", c"".as_ptr(), || {
        LAST_ERROR
            .try_with(|slot| slot.borrow().as_ptr())
            .unwrap_or(c"".as_ptr())
    })
}
