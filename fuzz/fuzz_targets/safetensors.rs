//! A whole safetensors file: header length, JSON header, data section.
//! Opening must either fail with an error or give tensors whose views lie
//! inside the file and whose typed accessors agree with their shapes.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use nanoinfer::model::safetensors::WeightFiles;

fuzz_target!(|data: &[u8]| {
    let path = common::scratch_dir().join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    let Ok(files) = WeightFiles::open_file(&path) else {
        return;
    };
    let names: Vec<String> = files.tensor_names().map(str::to_string).collect();
    assert_eq!(names.len(), files.len());
    for name in &names {
        let info = files.info(name).expect("listed tensor has info");
        assert!(info.byte_len <= data.len());
        let Some(view) = files.get(name) else {
            continue; // a dtype the reader lists but does not view
        };
        let numel: usize = view.shape.iter().product();
        assert_eq!(view.numel(), numel, "{name}");
        assert_eq!(view.bytes.len(), numel * view.dtype.size_in_bytes());
        // Typed access reads every byte (zero-copy or copied when misaligned).
        if let Ok(v) = view.to_f32() {
            assert_eq!(v.len(), numel);
            std::hint::black_box(v.iter().fold(0u32, |a, x| a ^ x.to_bits()));
        }
        if let Ok(v) = view.as_i32() {
            assert_eq!(v.len(), numel);
        }
        if let Ok(v) = view.as_i8() {
            assert_eq!(v.len(), numel);
        }
        let _ = files.require(name, view.shape);
    }
    std::hint::black_box(files.metadata().len());
});
