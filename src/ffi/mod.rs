//! The C ABI: the only place with `extern "C"`.
//!
//! Conventions (see docs/DESIGN.md, "C ABI conventions"):
//! - `ni_` prefix for functions and types, `NI_` for constants;
//! - opaque handles with one `*_free` each, `*_free(NULL)` is a no-op;
//! - fallible calls return `ni_status` and write results through
//!   out-parameters, which are left untouched on failure;
//! - `ni_last_error()` holds a thread-local message for the last failure;
//! - params structs start with `uint32_t struct_size` and are filled by
//!   `ni_*_params_init`;
//! - every exported function runs inside a panic boundary (`boundary`);
//! - memory the library returns is freed by the library.
//!
//! `include/nanoinfer.h` is generated from these files by cbindgen
//! (`cbindgen.toml`); `tests/ffi_header.rs` fails when it is stale. The doc
//! comments on exported items therefore *are* the C documentation.
//!
//! Enumerations are `typedef`s of fixed-width integers plus `#define`d
//! constants rather than C enums: a value coming from C is read as a plain
//! integer and validated, so an out-of-range value is an error, never
//! undefined behaviour.

#![allow(non_camel_case_types)]
// The safety contract of every exported `unsafe fn` is its C documentation:
// pointer arguments are NULL or valid for the documented use.
#![allow(clippy::missing_safety_doc)]

#[cfg(panic = "abort")]
compile_error!("the C ABI maps panics to NI_ERR_PANIC and needs panic = \"unwind\"");

// Declaration order is the order of the generated header (cbindgen follows
// it); the blank lines keep rustfmt from sorting the modules.
mod version;

mod status;

mod boundary;

mod alloc;

mod log;

mod model;

mod text;

mod session;

mod request;

mod step;

mod state;

mod abort;

mod debug;

mod args;

pub use abort::*;
pub use alloc::*;
pub use boundary::ni_last_error;
pub use debug::*;
pub use log::*;
pub use model::*;
pub use request::*;
pub use session::*;
pub use state::*;
pub use status::*;
pub use step::*;
pub use text::*;
pub use version::*;
