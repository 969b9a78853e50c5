//! Buffers the library hands to the caller. They come from `malloc` so that
//! they can be freed without knowing their length, but callers must free
//! them with the matching `ni_*_free`, never with `free()`: the library may
//! change allocators.

use crate::{Error, ErrorKind, Result};
use std::ffi::c_char;

fn malloc_bytes(bytes: usize, what: &str) -> Result<*mut u8> {
    // SAFETY: malloc may be called with any size; NULL is handled.
    let p = unsafe { libc::malloc(bytes.max(1)) }.cast::<u8>();
    if p.is_null() {
        return Err(Error::new(
            ErrorKind::OutOfMemory,
            format!("cannot allocate {bytes} bytes for {what}"),
        ));
    }
    Ok(p)
}

/// A NUL-terminated copy of `s` (which may itself contain NUL bytes; the
/// caller gets the length separately).
pub(crate) fn alloc_string(s: &[u8]) -> Result<*mut c_char> {
    let p = malloc_bytes(s.len() + 1, "a string")?;
    // SAFETY: p has room for len + 1 bytes and does not overlap `s`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), p, s.len());
        *p.add(s.len()) = 0;
    }
    Ok(p.cast())
}

/// A copy of `tokens`; NULL for an empty list.
pub(crate) fn alloc_tokens(tokens: &[u32]) -> Result<*mut u32> {
    if tokens.is_empty() {
        return Ok(std::ptr::null_mut());
    }
    let p = malloc_bytes(std::mem::size_of_val(tokens), "a token array")?.cast::<u32>();
    // SAFETY: malloc's result is aligned for any type and has room for all tokens.
    unsafe { std::ptr::copy_nonoverlapping(tokens.as_ptr(), p, tokens.len()) };
    Ok(p)
}

/// A copy of `bytes`; never NULL (an empty copy is a 1-byte allocation).
pub(crate) fn alloc_bytes(bytes: &[u8]) -> Result<*mut u8> {
    let p = malloc_bytes(bytes.len(), "a byte buffer")?;
    // SAFETY: p has room for `bytes.len()` bytes and does not overlap `bytes`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    Ok(p)
}

/// Frees a string returned by the library (`ni_detokenize`,
/// `ni_apply_chat_template`). NULL is a no-op.
///
/// Thread-safety: any thread; each string is freed once.
#[no_mangle]
pub unsafe extern "C" fn ni_string_free(s: *mut c_char) {
    // SAFETY: `s` is NULL or came from `alloc_string` (malloc), per the contract.
    super::boundary::ffi_value("ni_string_free", (), || unsafe { libc::free(s.cast()) })
}

/// Frees a token array returned by `ni_tokenize`, `ni_tokenize_ex` or
/// `ni_tokenize_chat`. NULL is a no-op.
///
/// Thread-safety: any thread; each array is freed once.
#[no_mangle]
pub unsafe extern "C" fn ni_tokens_free(tokens: *mut u32) {
    // SAFETY: `tokens` is NULL or came from `alloc_tokens` (malloc), per the contract.
    super::boundary::ffi_value("ni_tokens_free", (), || unsafe {
        libc::free(tokens.cast())
    })
}

/// Frees a byte buffer returned by the library (`ni_session_save_state`).
/// NULL is a no-op.
///
/// Thread-safety: any thread; each buffer is freed once.
#[no_mangle]
pub unsafe extern "C" fn ni_bytes_free(data: *mut u8) {
    // SAFETY: `data` is NULL or came from `alloc_bytes` (malloc), per the contract.
    super::boundary::ffi_value("ni_bytes_free", (), || unsafe { libc::free(data.cast()) })
}
