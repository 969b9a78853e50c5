//! Gives the shared library an ABI-versioned SONAME (`libnanoinfer.so.N`,
//! N = `NI_ABI_VERSION` in src/ffi/version.rs) so programs linked against it
//! record that name, and a relocatable install name on macOS.

use std::fs;

fn abi_version() -> u32 {
    let path = "src/ffi/version.rs";
    let src = fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    src.lines()
        .find_map(|l| l.trim().strip_prefix("pub const NI_ABI_VERSION: u32 = "))
        .and_then(|rest| rest.trim_end_matches(';').trim().parse().ok())
        .unwrap_or_else(|| panic!("{path} has no `pub const NI_ABI_VERSION: u32 = N;` line"))
}

fn main() {
    println!("cargo:rerun-if-changed=src/ffi/version.rs");
    println!("cargo:rerun-if-changed=build.rs");
    let abi = abi_version();
    match std::env::var("CARGO_CFG_TARGET_OS").as_deref() {
        Ok("linux") | Ok("freebsd") | Ok("android") => {
            println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnanoinfer.so.{abi}");
        }
        Ok("macos") | Ok("ios") => {
            println!(
                "cargo:rustc-cdylib-link-arg=-Wl,-install_name,@rpath/libnanoinfer.{abi}.dylib"
            );
        }
        _ => {}
    }
}
