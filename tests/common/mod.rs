//! Shared helpers of the integration tests: model paths and golden files.
#![allow(dead_code)]

pub mod checkpoint_edit;
pub mod choosable;
pub mod conformance;
pub mod dequant;
pub mod smollm2;

use nanoinfer::engine::{Model, ModelParams};
use nanoinfer::model::{QuantMode, WeightDType};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// The default real model; fails (not skips) when missing, naming the fix.
pub fn smollm2_dir(dtype_suffix: &str) -> PathBuf {
    let base = std::env::var("NANOINFER_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo_path("models/SmolLM2-135M-Instruct"));
    let dir = PathBuf::from(format!("{}{dtype_suffix}", base.display()));
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run `python3 scripts/fetch_model.py{}` (scripts/test.sh does)",
        dir.display(),
        if dtype_suffix.is_empty() {
            String::new()
        } else {
            " --dtype bf16".to_string()
        }
    );
    dir
}

pub fn load_model(dir: &Path, dtype: WeightDType) -> Arc<Model> {
    load_quantized(dir, dtype, QuantMode::None)
}

/// Loads with quantization at load (`QuantMode::None` for checkpoints that
/// are quantized already or dense).
pub fn load_quantized(dir: &Path, dtype: WeightDType, quant: QuantMode) -> Arc<Model> {
    let params = ModelParams {
        dtype,
        threads: 2,
        quant,
        ..Default::default()
    };
    Arc::new(
        Model::load(dir, &params, None)
            .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display())),
    )
}

/// Loading `dir` fails with an error whose text contains `want`.
pub fn assert_load_fails(dir: &Path, params: &ModelParams, want: &str) {
    let err = Model::load(dir, params, None)
        .err()
        .expect("load must fail");
    assert!(
        err.to_string().contains(want),
        "expected `{want}` in: {err}"
    );
}

/// A fresh (emptied) directory under the system temp dir, unique per process.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nanoinfer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn golden(name: &str) -> Value {
    let path = repo_path(&format!("tests/data/goldens/{name}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden is JSON")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// `a` within `rel` of `b`, relative to max(|b|, 1).
pub fn close(a: f32, b: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * b.abs().max(1.0)
}

/// Runs the `nanoinfer` binary of this build with `args`: (exit code, stdout, stderr).
pub fn nanoinfer(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nanoinfer"))
        .args(args)
        .output()
        .expect("runs nanoinfer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
