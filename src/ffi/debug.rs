//! Testing hooks. They let tests prove that a panic inside the library
//! becomes `NI_ERR_PANIC` and leaves objects usable. Disabled unless the
//! environment variable `NANOINFER_TEST_HOOKS=1` is set (or a Rust test
//! calls `enable_test_hooks`).

use super::args;
use super::boundary::ffi_call;
use super::session::ni_session;
use super::status::ni_status;
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Enables the testing hooks for this process (Rust tests only).
#[doc(hidden)]
pub fn enable_test_hooks() {
    ENABLED.store(true, Ordering::SeqCst);
}

fn enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
        || crate::tuning::var("NANOINFER_TEST_HOOKS").is_some_and(|v| v == "1")
}

fn force_panic(session: *mut ni_session) -> Result<()> {
    if !enabled() {
        return Err(Error::unsupported(
            "ni_debug_force_panic is a testing hook; set NANOINFER_TEST_HOOKS=1 to enable it",
        ));
    }
    if session.is_null() {
        panic!("forced by ni_debug_force_panic (testing only)");
    }
    // SAFETY: a non-NULL session is a live handle (contract).
    let s = unsafe { args::handle(session, "session")? };
    s.lock()?.panic_next_step = true;
    Ok(())
}

/// TESTING ONLY. With `NANOINFER_TEST_HOOKS=1` in the environment: when
/// `session` is NULL, panics inside the library at once (the call returns
/// `NI_ERR_PANIC`); otherwise arms `session` so that its next
/// `ni_session_step` panics while holding the session's lock (that step
/// returns `NI_ERR_PANIC`, and the session stays usable afterwards).
/// Without the variable it returns `NI_ERR_UNSUPPORTED` and does nothing.
///
/// Thread-safety: as `ni_session_cancel`.
#[no_mangle]
pub unsafe extern "C" fn ni_debug_force_panic(session: *mut ni_session) -> ni_status {
    ffi_call("ni_debug_force_panic", || force_panic(session))
}

/// TESTING ONLY (Rust tests; not part of the C ABI): installs a fault plan
/// on the session behind a C handle, so the C-ABI tests can fail its pool,
/// KV cache or forward pass at chosen steps (see
/// [`Session::inject_faults`](crate::engine::Session::inject_faults)).
///
/// # Safety
/// `session` is NULL or a live handle from `ni_session_create`.
#[doc(hidden)]
pub unsafe fn debug_inject_faults(
    session: *mut ni_session,
    plan: crate::engine::FaultPlan,
) -> Result<()> {
    // SAFETY: the caller passes NULL (refused) or a live handle.
    let s = unsafe { args::handle(session, "session")? };
    s.lock()?.session.inject_faults(plan);
    Ok(())
}
