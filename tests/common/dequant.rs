//! Dense copies of int4 and FP8 checkpoints: every quantized layer
//! dequantized to F32 (or BF16, for models too large to double in F32), the
//! same weights the quantized kernels multiply, for comparing against the
//! dense code paths.

use nanoinfer::backend::cpu::Matrix;
use nanoinfer::model::safetensors::WeightFiles;
use nanoinfer::model::{ModelConfig, QuantMethod};
use std::path::Path;

/// All rows of `m` as f32.
pub fn rows_of(m: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; m.rows * m.cols];
    for r in 0..m.rows {
        m.row_to_f32(r, &mut out[r * m.cols..(r + 1) * m.cols]);
    }
    out
}

/// Element type of a dense copy's tensors.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum DenseDType {
    F32,
    /// Rounded to nearest even, as a BF16 load of the F32 copy rounds.
    BF16,
}

impl DenseDType {
    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            DenseDType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DenseDType::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
        }
    }

    fn safetensors(self) -> safetensors::Dtype {
        match self {
            DenseDType::F32 => safetensors::Dtype::F32,
            DenseDType::BF16 => safetensors::Dtype::BF16,
        }
    }
}

/// Writes the int4 checkpoint `dir` (format `method`, shapes from `c`) to
/// `out` with every int4 layer dequantized to F32 and the other tensors
/// widened to F32; config.json loses its `quantization_config`, tokenizer
/// files are copied where present.
pub fn dequantized_copy(dir: &Path, c: &ModelConfig, method: &dyn QuantMethod, out: &Path) {
    dequantized_copy_as(dir, c, method, out, DenseDType::F32)
}

/// `dequantized_copy` with the dense tensors in `dtype`.
pub fn dequantized_copy_as(
    dir: &Path,
    c: &ModelConfig,
    method: &dyn QuantMethod,
    out: &Path,
    dtype: DenseDType,
) {
    std::fs::create_dir_all(out).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if dir.join(f).exists() {
            std::fs::copy(dir.join(f), out.join(f)).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let files = WeightFiles::open(dir).unwrap();
    let (d, i) = (c.hidden_size, c.intermediate_size);
    let (nq, nkv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in files.tensor_names() {
        let scales = [
            ".qzeros",
            ".scales",
            ".g_idx",
            ".weight_scale_inv",
            ".weight_scale",
        ];
        if scales.iter().any(|s| name.ends_with(s)) || name.ends_with(".input_scale") {
            continue;
        }
        if let Some(p) = name.strip_suffix(".qweight") {
            let (rows, cols) = match p.rsplit('.').next().unwrap() {
                "q_proj" => (nq, d),
                "o_proj" => (d, nq),
                "k_proj" | "v_proj" => (nkv, d),
                "gate_proj" | "up_proj" => (i, d),
                "down_proj" => (d, i),
                "lm_head" => (c.vocab_size, d),
                other => panic!("unexpected layer {other}"),
            };
            let wname = format!("{p}.weight");
            let m = method.load(&files, &wname, rows, cols).unwrap();
            tensors.push((wname, vec![rows, cols], dtype.encode(&rows_of(&m))));
        } else if method.stored_in(&files, name) {
            // FP8: the codes under the weight's own name.
            let shape = files.get(name).unwrap().shape.to_vec();
            let m = method.load(&files, name, shape[0], shape[1]).unwrap();
            tensors.push((name.to_string(), shape, dtype.encode(&rows_of(&m))));
        } else {
            let v = files.get(name).unwrap();
            let bytes = dtype.encode(&v.to_f32().unwrap());
            tensors.push((name.to_string(), v.shape.to_vec(), bytes));
        }
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dtype.safetensors(), s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
}
