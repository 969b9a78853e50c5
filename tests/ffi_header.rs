//! The committed C header must equal what cbindgen generates from src/ffi/.
//! Regenerate it with `NANOINFER_BLESS=1 cargo test --release --test ffi_header`.

use std::path::Path;

#[test]
fn committed_header_matches_cbindgen() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("header is UTF-8");
    let path = root.join("include/nanoinfer.h");
    if std::env::var("NANOINFER_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/nanoinfer.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first_diff = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or(
                committed.lines().count().min(generated.lines().count()),
                |i| i,
            )
            + 1;
        panic!(
            "include/nanoinfer.h is stale (first difference at line {first_diff}); regenerate it with \
             `NANOINFER_BLESS=1 cargo test --release --test ffi_header` and commit it"
        );
    }
}
