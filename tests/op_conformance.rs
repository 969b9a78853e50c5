//! The op conformance suite (`common/conformance.rs`) on the CPU backend,
//! for each weight format the CPU multiplies: F32, BF16, Q8_0 (quantized
//! at load) and int4 (an AWQ checkpoint). `tests/cuda.rs` runs the same
//! body on a GPU.

mod common;

use common::conformance::{check_backend, write_int4};
use common::{load_quantized, scratch_dir};
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::{QuantMode, WeightDType};

// Tolerances: about three times the worst deviation measured (F32 1e-6,
// BF16 9.5e-3, Q8_0 2.5e-2, int4 2.1e-2 on an AVX-512 EPYC, the same
// order on the AVX2 and scalar paths). `a_wrong_op_exceeds_every_tolerance`
// shows that an op left out deviates by more.

/// The reference reads the checkpoint the backend loaded, or its
/// dequantized copy, so a tolerance bounds the arithmetic of the ops, not
/// the weight format's rounding (except activation rounding of Q8_0 and
/// int4 products, and BF16 activations).
fn check(label: &str, dtype: WeightDType, quant: QuantMode, tolerance: f64) {
    let scratch = scratch_dir(&format!("conformance-{label}"));
    let int4 = label == "int4";
    let load = |dense: &std::path::Path, case: &std::path::Path| {
        if int4 {
            let (packed, reference) = (case.join("int4"), case.join("dequantized"));
            write_int4(dense, &packed, &reference);
            (load_quantized(&packed, dtype, quant), reference)
        } else {
            (load_quantized(dense, dtype, quant), dense.to_path_buf())
        }
    };
    let report = check_backend(
        label,
        &scratch,
        MemoryPoolKind::default_for(false),
        tolerance,
        &load,
    );
    eprintln!("{}", report.join("\n"));
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn cpu_f32_ops_match_the_f64_reference() {
    check("f32", WeightDType::F32, QuantMode::None, 1e-5);
}

#[test]
fn cpu_bf16_ops_match_the_f64_reference() {
    check("bf16", WeightDType::BF16, QuantMode::None, 2.5e-2);
}

#[test]
fn cpu_q8_0_ops_match_the_f64_reference() {
    check("q8_0", WeightDType::F32, QuantMode::Q8_0_DEFAULT, 6e-2);
}

#[test]
fn cpu_int4_ops_match_the_f64_reference_of_the_dequantized_weights() {
    check("int4", WeightDType::F32, QuantMode::None, 6e-2);
}

/// The suite can fail: a reference that leaves out one op (the q/k/v
/// biases, or Qwen3's q/k norms) deviates from the F32 backend by more
/// than the loosest tolerance above.
#[test]
fn a_wrong_op_exceeds_every_tolerance() {
    use common::conformance::{run, shapes, write_model, Family, Isolate, Mapping, Reference};
    let scratch = scratch_dir("conformance-sensitivity");
    for (family, left_out) in [(Family::Qwen2, ".bias"), (Family::Qwen3, "_norm.weight")] {
        let shape = shapes().into_iter().find(|s| s.family == family).unwrap();
        let dir = scratch.join(format!("{family:?}"));
        write_model(&dir, &shape, Isolate::Whole, 5);
        let model = load_quantized(&dir, WeightDType::F32, QuantMode::None);
        let mut wrong = Reference::open(&dir);
        assert!(
            wrong.leave_out(left_out) > 0,
            "{family:?} has no {left_out}"
        );
        let pool = MemoryPoolKind::default_for(false);
        let dev = run(&model, pool, Mapping::Paged, &wrong);
        assert!(
            dev.layer0_kv > 0.2 && dev.logits > 0.2,
            "{family:?} without {left_out}: {dev:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
