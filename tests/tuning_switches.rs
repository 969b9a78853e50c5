//! The environment switch table (`src/tuning.rs`) is the only list of
//! `NANOINFER_*` switches: every name the library's code mentions is in it,
//! every entry is read by the code, `docs/tuning.md` is generated from it,
//! and the docs name no switch that does not exist.
//! Regenerate the doc with `NANOINFER_BLESS=1 cargo test --release --test tuning_switches`.

use nanoinfer::tuning::{lookup, markdown, SWITCHES};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `NANOINFER_[A-Z0-9_]+` word in `text`.
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("NANOINFER_") {
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        out.insert(word.trim_end_matches('_').to_string());
    }
    out
}

fn read_tree(dir: &Path, exts: &[&str], out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_tree(&path, exts, out);
        } else if path
            .extension()
            .is_some_and(|e| exts.iter().any(|x| e == *x))
        {
            out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
        }
    }
}

#[test]
fn every_switch_the_code_names_is_in_the_table_and_read() {
    let src = root().join("src");
    let mut code = String::new();
    read_tree(&src, &["rs"], &mut code);
    let table = std::fs::read_to_string(src.join("tuning.rs")).unwrap();
    let outside_table = code.replace(&table, "");
    let unlisted: Vec<_> = names(&outside_table)
        .into_iter()
        .filter(|n| lookup(n).is_none())
        .collect();
    assert!(
        unlisted.is_empty(),
        "NANOINFER_* names in src/ missing from src/tuning.rs: {unlisted:?}"
    );
    let unread: Vec<_> = SWITCHES
        .iter()
        .filter(|s| !outside_table.contains(&format!("\"{}\"", s.name)))
        .map(|s| s.name)
        .collect();
    assert!(
        unread.is_empty(),
        "switches in the table that no code reads: {unread:?}"
    );
    let mut seen = BTreeSet::new();
    for s in SWITCHES {
        assert!(seen.insert(s.name), "{} listed twice", s.name);
        assert!(
            !s.doc.is_empty() && !s.default.is_empty(),
            "{} undocumented",
            s.name
        );
    }
}

#[test]
fn docs_tuning_md_is_generated_from_the_table() {
    let path = root().join("docs/tuning.md");
    let generated = markdown();
    if std::env::var("NANOINFER_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/tuning.md is stale: NANOINFER_BLESS=1 cargo test --release --test tuning_switches"
    );
}

/// A `NANOINFER_*` name in the user-facing docs is a switch of the table or
/// a variable of the scripts and tests (`NANOINFER_MODEL`, ...), never one
/// that no longer exists.
#[test]
fn the_docs_name_only_switches_that_exist() {
    let r = root();
    let mut known = String::new();
    for dir in [
        "scripts",
        "tests",
        ".ci",
        "examples",
        "examples-c",
        "bindings",
        "fuzz",
        "src",
        "server",
    ] {
        let d = r.join(dir);
        if d.is_dir() {
            read_tree(
                &d,
                &["sh", "py", "rs", "go", "c", "cpp", "cuh", "cu", ""],
                &mut known,
            );
        }
    }
    known.push_str(&std::fs::read_to_string(r.join(".ci/run")).unwrap_or_default());
    known.push_str(&std::fs::read_to_string(r.join("CMakeLists.txt")).unwrap_or_default());
    let known_names = names(&known);
    let mut stale = Vec::new();
    for doc in [
        "README.md",
        "TESTING.md",
        "BENCHMARKS.md",
        "docs/DESIGN.md",
        "scripts/README.md",
    ] {
        let text = std::fs::read_to_string(r.join(doc)).unwrap_or_default();
        for n in names(&text) {
            if lookup(&n).is_none() && !known_names.contains(&n) {
                stale.push(format!("{doc}: {n}"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "docs name switches that do not exist: {stale:?}"
    );
}
