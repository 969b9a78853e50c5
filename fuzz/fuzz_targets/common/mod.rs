//! Helpers shared by the fuzz targets.
#![allow(dead_code)]

use nanoinfer::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A private scratch directory for this process (tmpfs when available):
/// the loaders under test read files, so inputs are written there.
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("nanoinfer-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        dir
    })
}

/// The repository root: the manifest's directory in the normal test suite,
/// its parent in the fuzz crate (fuzz/).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("fuzz_targets").is_dir() {
        manifest.join("..")
    } else {
        manifest
    }
}

/// The tokenizers under test, loaded once: the two small test tokenizers
/// (byte-level BPE with a ChatML template; SentencePiece-style BPE with byte
/// fallback) and, when present, SmolLM2's.
pub fn tokenizers() -> &'static [Tokenizer] {
    static TOKS: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    TOKS.get_or_init(|| {
        let root = repo_root();
        let mut v = vec![];
        for dir in [
            root.join("tests/data/tokenizer/bytelevel"),
            root.join("tests/data/tokenizer/spm"),
            root.join("models/SmolLM2-135M-Instruct"),
        ] {
            if dir.join("tokenizer.json").exists() {
                v.push(Tokenizer::from_dir(&dir).expect("test tokenizer loads"));
            }
        }
        assert!(
            v.len() >= 2,
            "test tokenizers missing under tests/data/tokenizer"
        );
        v
    })
}

/// Splits `data` at NUL bytes.
pub fn split_nul(data: &[u8]) -> Vec<&[u8]> {
    data.split(|&b| b == 0).collect()
}

/// libfuzzer-sys installs a panic hook that aborts on every panic, even one
/// the library catches itself (it wraps minijinja's render and the
/// tokenizers crate in `catch_unwind` and returns an error). This hook
/// only reports the first few panics. An uncaught panic still fails the run:
/// libfuzzer-sys catches it around the target and aborts.
pub fn allow_caught_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        static SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        std::panic::set_hook(Box::new(|info| {
            if SEEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 3 {
                eprintln!("panic (fails the run unless the library catches it): {info}");
            }
        }));
    });
}
