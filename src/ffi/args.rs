//! Checked conversions of raw C arguments. Each names the argument in its
//! error so that `ni_last_error()` says which one was wrong.

use crate::{bail_arg, Result};
use std::ffi::{c_char, CStr};

/// A handle argument; NULL is an error.
///
/// # Safety
/// A non-NULL `ptr` must point to a live object created by this library.
pub(crate) unsafe fn handle<'a, T>(ptr: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: the caller guarantees a non-NULL pointer is a live handle.
    match unsafe { ptr.as_ref() } {
        Some(r) => Ok(r),
        None => bail_arg!("{what} is NULL"),
    }
}

/// An out-parameter; NULL is an error. Write it with `ptr::write` only
/// once the call has succeeded.
pub(crate) fn out_ptr<T>(ptr: *mut T, what: &str) -> Result<*mut T> {
    if ptr.is_null() {
        bail_arg!("{what} (out-parameter) is NULL");
    }
    if !ptr.is_aligned() {
        bail_arg!("{what} (out-parameter) is not aligned for its type");
    }
    Ok(ptr)
}

/// A caller array of `len` elements; NULL is allowed only when `len` is 0.
///
/// # Safety
/// A non-NULL `ptr` must point to `len` initialised elements that stay
/// valid and unmodified for `'a`.
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T]> {
    if ptr.is_null() {
        if len != 0 {
            bail_arg!("{what} is NULL but its length is {len}");
        }
        return Ok(&[]);
    }
    if !ptr.is_aligned() {
        bail_arg!("{what} is not aligned for its element type");
    }
    if len
        .checked_mul(size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        bail_arg!("{what} has an impossible length {len}");
    }
    // SAFETY: non-NULL, aligned, size checked; validity promised by the caller.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

fn utf8<'a>(bytes: &'a [u8], what: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        crate::Error::invalid_arg(format!(
            "{what} is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })
}

/// UTF-8 text given as pointer + byte length (no NUL needed).
///
/// # Safety
/// As for `slice`.
pub(crate) unsafe fn text<'a>(ptr: *const c_char, len: usize, what: &str) -> Result<&'a str> {
    // SAFETY: forwarded contract.
    let bytes = unsafe { slice(ptr.cast::<u8>(), len, what)? };
    utf8(bytes, what)
}

/// A NUL-terminated byte string; NULL is an error.
///
/// # Safety
/// A non-NULL `ptr` must point to a NUL-terminated string valid for `'a`.
pub(crate) unsafe fn cstr_bytes<'a>(ptr: *const c_char, what: &str) -> Result<&'a [u8]> {
    if ptr.is_null() {
        bail_arg!("{what} is NULL");
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    Ok(unsafe { CStr::from_ptr(ptr) }.to_bytes())
}

/// A NUL-terminated UTF-8 string; NULL is an error.
///
/// # Safety
/// As for `cstr_bytes`.
pub(crate) unsafe fn cstr<'a>(ptr: *const c_char, what: &str) -> Result<&'a str> {
    // SAFETY: forwarded contract.
    utf8(unsafe { cstr_bytes(ptr, what)? }, what)
}

/// A params struct that grows by appending fields: the `struct_size` of
/// each earlier layout it still accepts (see [`params_versioned`]).
pub(crate) trait Appendable: Copy {
    const OLDER_SIZES: &'static [usize];
}

/// Copies a params struct after checking its `struct_size` (its first
/// field), accepting the older layouts `T` lists; NULL selects `defaults`.
///
/// # Safety
/// A non-NULL `ptr` must point to a `T` initialised by the matching
/// `ni_*_params_init` of the caller's header (and then possibly modified).
pub(crate) unsafe fn params<T: Appendable>(
    ptr: *const T,
    defaults: impl FnOnce() -> T,
    what: &str,
) -> Result<T> {
    // SAFETY: forwarded contract; the older sizes are T's own.
    unsafe { params_versioned(ptr, defaults, T::OLDER_SIZES, what) }
}

/// Like [`params`], but also accepts the sizes of earlier versions of `T`
/// (`older_sizes`, each a prefix of today's layout that ends on a field
/// boundary): the fields such a caller knows are copied over `defaults`, and
/// the fields appended since keep their defaults. This is what lets a params
/// struct grow at its end without breaking callers built against an older
/// header.
///
/// # Safety
/// A non-NULL `ptr` must point to `struct_size` initialised bytes laid out
/// as the first `struct_size` bytes of `T` (a struct initialised by the
/// `ni_*_params_init` of the header the caller was built with).
pub(crate) unsafe fn params_versioned<T: Copy>(
    ptr: *const T,
    defaults: impl FnOnce() -> T,
    older_sizes: &[usize],
    what: &str,
) -> Result<T> {
    if ptr.is_null() {
        return Ok(defaults());
    }
    if !ptr.is_aligned() {
        bail_arg!("{what} is not aligned for its type");
    }
    // SAFETY: non-NULL and aligned; every params struct starts with a u32.
    let size = unsafe { ptr.cast::<u32>().read() };
    let expected = size_of::<T>();
    if size == 0 {
        bail_arg!(
            "{what}.struct_size is 0: initialise the struct with its ni_*_params_init function"
        );
    }
    if size as usize == expected {
        // SAFETY: the caller guarantees a fully initialised T.
        return Ok(unsafe { ptr.read() });
    }
    if older_sizes.contains(&(size as usize)) {
        debug_assert!((size as usize) < expected);
        let mut value = defaults();
        // SAFETY: `size` < size_of::<T>() bytes are readable at `ptr` (the
        // caller's older struct) and writable at `value`; the regions are
        // distinct. The prefix ends on a field boundary, so every field of
        // `value` is either wholly copied from the caller or left at its
        // default. struct_size keeps the caller's value, which nothing reads.
        unsafe {
            std::ptr::copy_nonoverlapping(
                ptr.cast::<u8>(),
                (&mut value as *mut T).cast::<u8>(),
                size as usize,
            )
        };
        return Ok(value);
    }
    bail_arg!(
        "{what}.struct_size is {size} but this library expects {expected}{}: the header used to build \
         the caller does not match the library (compare NI_ABI_VERSION with ni_abi_version())",
        if older_sizes.is_empty() {
            String::new()
        } else {
            format!(" (or an older {older_sizes:?})")
        }
    )
}

/// Checks the `struct_size` of a caller-provided output struct.
pub(crate) fn out_struct<T>(ptr: *mut T, what: &str) -> Result<*mut T> {
    let ptr = out_ptr(ptr, what)?;
    // SAFETY: non-NULL and aligned (checked); output structs start with a u32 the caller sets.
    let size = unsafe { ptr.cast::<u32>().read() };
    let expected = size_of::<T>();
    if size as usize != expected {
        bail_arg!("{what}->struct_size is {size}; set it to sizeof of the struct ({expected}) before the call");
    }
    Ok(ptr)
}
