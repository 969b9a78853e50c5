//! Rewriting a test checkpoint's `model.safetensors` in place.

use std::path::Path;

pub type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;
pub type Meta = std::collections::HashMap<String, String>;

/// Rewrites `dir/model.safetensors` with `edit` applied to its tensors and metadata.
pub fn rewrite(dir: &Path, edit: impl FnOnce(&mut Tensors, &mut Meta)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap_or_default();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors, &mut meta);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, Some(meta), &path).unwrap();
}

/// Copies the regular files of `from` into a fresh `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Sets (or with `None` removes) config.json's `quantization_config`.
pub fn set_quantization_config(dir: &Path, qc: Option<serde_json::Value>) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    match qc {
        Some(qc) => v["quantization_config"] = qc,
        None => {
            v.as_object_mut().unwrap().remove("quantization_config");
        }
    }
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}
