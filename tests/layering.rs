//! The library's layers, written once, and a check that no module imports
//! a layer above it (or a peer of its own layer): a backend must not learn
//! about the engine's scheduling, the memory layer about sampling, and so
//! on. Unit tests (`#[cfg(test)]` modules) may reach further up to drive
//! the crate end to end; they are not scanned.

use std::collections::BTreeSet;
use std::path::Path;

/// Top to bottom. A module may import only from layers below its own.
const LAYERS: &[&[&str]] = &[
    &["ffi"],
    &["engine"],
    &["quantize"],
    &["model"],
    &["kv", "sampling", "tokenizer"],
    &["backend"],
    &["memory"],
    &["forward"],
    &["tensor"],
    &["limits", "sysinfo", "tuning", "untrusted_file", "error"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The top-level modules `source` names through `crate::` paths, outside
/// comments and unit-test modules.
fn imports(source: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        if code.trim_start().starts_with("#[cfg(test)]") {
            // Unit tests sit at the end of a file by convention.
            break;
        }
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::X, b}`: every first segment in the group.
                let group = &group[..group.find('}').unwrap_or(group.len())];
                for item in group.split(',') {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        found.insert(name);
                    }
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() && rest[name.len()..].starts_with("::") {
                    found.insert(name);
                }
            }
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_imports_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    let mut unlisted = BTreeSet::new();
    for path in &files {
        let rel = path.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "bin" || module == "lib" {
            continue; // the CLI sits above the library; lib.rs only declares
        }
        let Some(own) = layer_of(&module) else {
            unlisted.insert(module);
            continue;
        };
        let source = std::fs::read_to_string(path).unwrap();
        for import in imports(&source) {
            if import == module {
                continue;
            }
            match layer_of(&import) {
                // Crate-root macros (`bail_arg`) and re-exports are not layers.
                None if !src.join(&import).is_dir()
                    && !src.join(format!("{import}.rs")).is_file() => {}
                None => {
                    unlisted.insert(import);
                }
                Some(l) if l > own || l == LAYERS.len() - 1 => {}
                Some(_) => {
                    violations.push(format!("{} ({module}) imports {import}", rel.display()))
                }
            }
        }
    }
    assert!(
        unlisted.is_empty(),
        "modules missing from LAYERS in tests/layering.rs: {unlisted:?}"
    );
    assert!(
        violations.is_empty(),
        "imports of a layer above or beside their own (order in tests/layering.rs):\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_scanner_sees_grouped_and_plain_paths() {
    let found = imports(
        "use crate::kv::{KvMapping, X};\nuse crate::{engine::Y, model};\nlet a = crate::sampling::f();\n// crate::ffi::z\n#[cfg(test)]\nuse crate::tokenizer::T;",
    );
    let want: BTreeSet<String> = ["kv", "engine", "model", "sampling"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(found, want);
}
