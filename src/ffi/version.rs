//! Library and ABI versions.

use std::ffi::c_char;

/// The ABI version this header describes. Compare it with `ni_abi_version()`
/// at run time to detect a header/library mismatch. It changes whenever a
/// declaration changes incompatibly.
pub const NI_ABI_VERSION: u32 = 2;

/// The crate version, e.g. `"0.1.0"`.
///
/// Ownership: static string; never free it. Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn ni_version() -> *const c_char {
    const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    super::boundary::ffi_value("ni_version", c"".as_ptr(), || VERSION.as_ptr().cast())
}

/// The ABI version the library was built with (`NI_ABI_VERSION` of its header).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn ni_abi_version() -> u32 {
    super::boundary::ffi_value("ni_abi_version", NI_ABI_VERSION, || NI_ABI_VERSION)
}
