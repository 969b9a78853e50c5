//! Saved conversations and prefix caches: save a request's state, continue
//! it later in any session of the same model, warm-start a prefix cache.

use super::alloc::alloc_bytes;
use super::args;
use super::boundary::ffi_call;
use super::request::{self, ni_request_params};
use super::session::ni_session;
use super::status::ni_status;
use crate::bail_arg;
use crate::engine::PrefixCacheReport;
use std::ffi::c_char;
use std::path::Path;

/// Saves the state of request `request_id` (its tokens, the KV of the
/// positions computed so far, where its output history starts and its
/// sampler's random stream) into a new buffer: `*out_data` (free it with
/// `ni_bytes_free`) of `*out_len` bytes. The request is waiting or running
/// (call between steps), or it ended with `retain_state` set and its state
/// was not released. The bytes restore with `ni_session_restore_request` into
/// any session of the same model and KV format, in this process or another.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_save_state(
    session: *mut ni_session,
    request_id: u64,
    out_data: *mut *mut u8,
    out_len: *mut usize,
) -> ni_status {
    ffi_call("ni_session_save_state", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        let data_out = args::out_ptr(out_data, "out_data")?;
        let len_out = args::out_ptr(out_len, "out_len")?;
        let bytes = s.lock()?.session.save_state_bytes(request_id)?;
        let data = alloc_bytes(&bytes)?;
        // SAFETY: both were checked non-NULL and aligned.
        unsafe {
            data_out.write(data);
            len_out.write(bytes.len());
        }
        Ok(())
    })
}

/// `ni_session_save_state` into the file at `path` (NUL-terminated UTF-8),
/// written whole or not at all (a temporary file renamed into place).
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_save_state_file(
    session: *mut ni_session,
    request_id: u64,
    path: *const c_char,
) -> ni_status {
    ffi_call("ni_session_save_state_file", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        // SAFETY: a NUL-terminated string (contract).
        let path = unsafe { args::cstr(path, "path")? };
        s.lock()?
            .session
            .save_state_file(request_id, Path::new(path))
    })
}

/// Queues a new request continuing the conversation saved in `data` (`len`
/// bytes from `ni_session_save_state`): its tokens, then the prompt of
/// `request` (may be empty: the output goes on where it stopped). `request`
/// gives the rest as for `ni_session_add_request` (NULL: the defaults). The
/// saved KV is copied in when the request is admitted, so only the
/// positions it lacks are computed. With `use_seed` the request continues
/// the saved random stream (a seeded conversation goes on exactly as if
/// never interrupted); without, it draws a fresh one. A state of another
/// model or KV format, one longer than this session allows, or corrupt in
/// any way fails with `NI_ERR_INVALID_ARGUMENT` naming the problem, and
/// nothing is queued. On success `*out_id` receives the new request's id.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_restore_request(
    session: *mut ni_session,
    data: *const u8,
    len: usize,
    request: *const ni_request_params,
    out_id: *mut u64,
) -> ni_status {
    ffi_call("ni_session_restore_request", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        // SAFETY: `len` readable bytes (contract).
        let data = unsafe { args::slice(data, len, "data")? };
        let out = args::out_ptr(out_id, "out_id")?;
        // SAFETY: per this function's contract.
        let params = unsafe { engine_params(s, request)? };
        let id = s.lock()?.session.restore_request_bytes(data, params)?;
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(id) };
        Ok(())
    })
}

/// `ni_session_restore_request` from the file at `path` (NUL-terminated
/// UTF-8) written by `ni_session_save_state_file`.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_restore_request_file(
    session: *mut ni_session,
    path: *const c_char,
    request: *const ni_request_params,
    out_id: *mut u64,
) -> ni_status {
    ffi_call("ni_session_restore_request_file", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        // SAFETY: a NUL-terminated string (contract).
        let path = unsafe { args::cstr(path, "path")? };
        let out = args::out_ptr(out_id, "out_id")?;
        // SAFETY: per this function's contract.
        let params = unsafe { engine_params(s, request)? };
        let id = s
            .lock()?
            .session
            .restore_request_file(Path::new(path), params)?;
        // SAFETY: out was checked non-NULL and aligned.
        unsafe { out.write(id) };
        Ok(())
    })
}

/// Frees the state kept for ended request `request_id` (`retain_state`).
/// An id with no kept state fails with `NI_ERR_INVALID_ARGUMENT`.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_release_state(
    session: *mut ni_session,
    request_id: u64,
) -> ni_status {
    ffi_call("ni_session_release_state", || {
        // SAFETY: per this function's contract.
        let s = unsafe { args::handle(session, "session")? };
        s.lock()?.session.release_state(request_id)
    })
}

/// Writes the session's prefix cache (every cached prompt prefix with its
/// KV and cache salt) to `dir/prefix_cache.nikv`, creating the directory
/// `dir` (NUL-terminated UTF-8) if needed. `*out_tokens` (may be NULL)
/// receives the number of cached tokens written.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_save_prefix_cache(
    session: *mut ni_session,
    dir: *const c_char,
    out_tokens: *mut usize,
) -> ni_status {
    // SAFETY: forwarded contract.
    unsafe {
        prefix_cache_call(
            "ni_session_save_prefix_cache",
            session,
            dir,
            out_tokens,
            |s, d| s.save_prefix_cache(d),
        )
    }
}

/// Warm-starts the prefix cache from `dir` (written by
/// `ni_session_save_prefix_cache` for the same model and KV format). The
/// whole file is checked first (a foreign, truncated or corrupt one fails
/// with `NI_ERR_INVALID_ARGUMENT` and changes nothing); its prefixes then
/// enter the cache within the session's KV budget. `*out_tokens` (may be
/// NULL) receives the number of tokens now cached from it.
///
/// Thread-safety: any thread; serialized with other calls on this session.
#[no_mangle]
pub unsafe extern "C" fn ni_session_load_prefix_cache(
    session: *mut ni_session,
    dir: *const c_char,
    out_tokens: *mut usize,
) -> ni_status {
    // SAFETY: forwarded contract.
    unsafe {
        prefix_cache_call(
            "ni_session_load_prefix_cache",
            session,
            dir,
            out_tokens,
            |s, d| s.load_prefix_cache(d),
        )
    }
}

/// Saving or loading the prefix cache of `session` in `dir`, its token
/// count written through `out_tokens` unless NULL.
///
/// # Safety
/// `session` and `dir` honour the exported functions' contracts.
unsafe fn prefix_cache_call(
    name: &'static str,
    session: *mut ni_session,
    dir: *const c_char,
    out_tokens: *mut usize,
    op: impl FnOnce(&mut crate::engine::Session, &Path) -> crate::Result<PrefixCacheReport>,
) -> ni_status {
    ffi_call(name, || {
        // SAFETY: per the exported function's contract.
        let s = unsafe { args::handle(session, "session")? };
        // SAFETY: a NUL-terminated string (contract).
        let dir = unsafe { args::cstr(dir, "dir")? };
        let report = op(&mut s.lock()?.session, Path::new(dir))?;
        write_optional(out_tokens, report.tokens)
    })
}

/// The engine request of `request` (NULL: the defaults, no prompt).
///
/// # Safety
/// `request` is NULL or honours `ni_request_params`' contract.
unsafe fn engine_params(
    s: &ni_session,
    request: *const ni_request_params,
) -> crate::Result<crate::engine::RequestParams> {
    let p = if request.is_null() {
        ni_request_params::default()
    } else {
        // SAFETY: non-NULL, per the contract.
        unsafe { args::params(request, ni_request_params::default, "request")? }
    };
    // SAFETY: the pointers inside the request follow its documented contract.
    unsafe { request::to_engine(&p, &s.model) }
}

/// Writes `value` through `out` unless it is NULL.
fn write_optional(out: *mut usize, value: usize) -> crate::Result<()> {
    if out.is_null() {
        return Ok(());
    }
    if !out.is_aligned() {
        bail_arg!("out_tokens is not aligned");
    }
    // SAFETY: non-NULL and aligned; the caller provides room for a size_t.
    unsafe { out.write(value) };
    Ok(())
}
