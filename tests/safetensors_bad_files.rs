//! The safetensors reader against real files on disk: every malformed case
//! is rejected with a message naming the file and the problem, sharded
//! indexes must agree with their shards, and valid files round-trip
//! (zero-copy where aligned, copied where not).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use nanoinfer::model::safetensors::{WeightFiles, INDEX_FILE, SINGLE_FILE};
use nanoinfer::tensor::dtype::SafetensorsDType;
use nanoinfer::tensor::DType;
use nanoinfer::{Error, ErrorKind};
use safetensors::tensor::{Dtype as StDtype, TensorView as StView};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("nanoinfer-st-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file from raw header text (padded with spaces to a multiple
/// of 8, as the reference writer does) and a data section.
fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    raw_file_exact(&h, data)
}

/// Like `raw_file`, without padding.
fn raw_file_exact(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes `bytes` as a single-file model and returns the error opening it,
/// after checking it is an `InvalidModel` error naming the file.
fn open_err(bytes: &[u8]) -> String {
    let dir = TempDir::new("bad");
    let path = dir.write(SINGLE_FILE, bytes);
    let err = WeightFiles::open(&dir.0).expect_err("malformed file should be rejected");
    assert_eq!(err.kind, ErrorKind::InvalidModel, "{}", err.message);
    assert!(
        err.message.contains(&path.display().to_string()),
        "file not named: {}",
        err.message
    );
    err.message
}

fn assert_rejected(bytes: &[u8], needle: &str) {
    let msg = open_err(bytes);
    assert!(msg.contains(needle), "expected '{needle}' in: {msg}");
}

fn entry(dtype: &str, shape: &[usize], begin: usize, end: usize) -> String {
    format!(r#"{{"dtype": "{dtype}", "shape": {shape:?}, "data_offsets": [{begin}, {end}]}}"#)
}

// ---- file-level framing -------------------------------------------------

#[test]
fn file_shorter_than_length_prefix() {
    assert_rejected(
        &[1, 2, 3, 4, 5],
        "file is 5 bytes, too short to hold the 8-byte header length",
    );
    assert_rejected(&[], "file is 0 bytes");
}

#[test]
fn header_length_past_end_of_file() {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}      ");
    assert_rejected(
        &bytes,
        "header length 1000 runs past the end of the file (16 bytes)",
    );
}

#[test]
fn header_length_over_limit() {
    let mut bytes = 200_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_rejected(
        &bytes,
        "header length 200000000 exceeds the 100000000-byte limit",
    );
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_rejected(&bytes, "exceeds the 100000000-byte limit");
}

#[test]
fn header_not_utf8_not_json_not_object() {
    assert_rejected(
        &raw_file_exact(b"{\"a\xff\xfe\": 1}", &[]),
        "header is not valid UTF-8",
    );
    assert_rejected(&raw_file("{\"w\": ", &[]), "header is not valid JSON");
    assert_rejected(&raw_file("{} {}", &[]), "header is not valid JSON");
    assert_rejected(
        &raw_file_exact(b"{}\0\0\0\0\0\0", &[]),
        "header is not valid JSON",
    );
    assert_rejected(
        &raw_file("[]", &[]),
        "header must be a JSON object, found an array",
    );
    assert_rejected(
        &raw_file("42", &[]),
        "header must be a JSON object, found a number",
    );
}

// ---- entries ------------------------------------------------------------

#[test]
fn metadata_must_be_string_map() {
    assert_rejected(
        &raw_file(r#"{"__metadata__": {"format": 1}}"#, &[]),
        "'__metadata__' value for key 'format' must be a string, found a number",
    );
    assert_rejected(
        &raw_file(r#"{"__metadata__": "pt"}"#, &[]),
        "'__metadata__' must be an object of string values, found a string",
    );
}

#[test]
fn entry_missing_fields() {
    for (field, body) in [
        ("dtype", r#"{"shape": [1], "data_offsets": [0, 4]}"#),
        ("shape", r#"{"dtype": "F32", "data_offsets": [0, 4]}"#),
        ("data_offsets", r#"{"dtype": "F32", "shape": [1]}"#),
    ] {
        let header = format!(r#"{{"layer.w": {body}}}"#);
        assert_rejected(
            &raw_file(&header, &[0; 4]),
            &format!("tensor 'layer.w': missing field '{field}'"),
        );
    }
}

#[test]
fn unknown_dtype() {
    let header = format!(r#"{{"w": {}}}"#, entry("Q4_K", &[1], 0, 4));
    assert_rejected(
        &raw_file(&header, &[0; 4]),
        "tensor 'w': unknown dtype 'Q4_K'",
    );
}

#[test]
fn shape_times_element_size_overflows() {
    let header = format!(r#"{{"w": {}}}"#, entry("F32", &[1 << 62, 8], 0, 4));
    assert_rejected(
        &raw_file(&header, &[0; 4]),
        "tensor 'w': element count of shape",
    );
    let header = format!(r#"{{"w": {}}}"#, entry("F64", &[1 << 62], 0, 4));
    assert_rejected(
        &raw_file(&header, &[0; 4]),
        "tensor 'w': byte size of shape",
    );
}

#[test]
fn byte_span_must_match_shape() {
    let header = format!(r#"{{"w": {}}}"#, entry("F32", &[2, 2], 0, 12));
    assert_rejected(
        &raw_file(&header, &[0; 12]),
        "tensor 'w': data_offsets [0, 12] span 12 bytes, but shape [2, 2] with dtype F32 needs 16",
    );
}

#[test]
fn begin_after_end() {
    let header = format!(r#"{{"w": {}}}"#, entry("F32", &[1], 8, 4));
    assert_rejected(
        &raw_file(&header, &[0; 8]),
        "tensor 'w': data_offsets [8, 4] have begin after end",
    );
}

#[test]
fn offsets_past_data_section() {
    let header = format!(r#"{{"w": {}}}"#, entry("F32", &[4], 0, 16));
    assert_rejected(
        &raw_file(&header, &[0; 10]),
        "tensor 'w': data_offsets [0, 16] run past the end of the data section (10 bytes",
    );
}

#[test]
fn overlapping_tensors() {
    let header = format!(
        r#"{{"a": {}, "b": {}}}"#,
        entry("F32", &[2], 0, 8),
        entry("F32", &[2], 4, 12)
    );
    assert_rejected(
        &raw_file(&header, &[0; 12]),
        "tensors 'a' [0, 8] and 'b' [4, 12] overlap",
    );
}

#[test]
fn gaps_and_trailing_bytes() {
    let header = format!(
        r#"{{"a": {}, "b": {}}}"#,
        entry("F32", &[1], 0, 4),
        entry("F32", &[1], 8, 12)
    );
    assert_rejected(
        &raw_file(&header, &[0; 12]),
        "gap in the data section: bytes [4, 8] before tensor 'b'",
    );
    let header = format!(r#"{{"a": {}}}"#, entry("F32", &[1], 4, 8));
    assert_rejected(
        &raw_file(&header, &[0; 8]),
        "bytes [0, 4] before tensor 'a'",
    );
    let header = format!(r#"{{"a": {}}}"#, entry("F32", &[1], 0, 4));
    assert_rejected(
        &raw_file(&header, &[0; 7]),
        "3 trailing bytes after the last tensor",
    );
}

#[test]
fn duplicate_tensor_name_in_header() {
    let header = format!(
        r#"{{"w": {}, "w": {}}}"#,
        entry("F32", &[1], 0, 4),
        entry("F32", &[1], 4, 8)
    );
    assert_rejected(
        &raw_file(&header, &[0; 8]),
        "duplicate tensor name 'w' in header",
    );
}

#[test]
fn empty_tensor_name() {
    let header = format!(r#"{{"": {}}}"#, entry("F32", &[1], 0, 4));
    assert_rejected(
        &raw_file(&header, &[0; 4]),
        "header has a tensor with an empty name",
    );
}

#[test]
fn truncated_file_behind_valid_header() {
    let dir = TempDir::new("trunc");
    let path = dir.path(SINGLE_FILE);
    let data = f32_bytes(&[1.0; 64]);
    let view = StView::new(StDtype::F32, vec![8, 8], &data).unwrap();
    safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 100]).unwrap();
    let err = WeightFiles::open(&dir.0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel);
    assert!(err.message.contains("tensor 'w'"), "{}", err.message);
    assert!(
        err.message.contains("is the file truncated?"),
        "{}",
        err.message
    );
}

#[test]
fn missing_files_and_directories() {
    let dir = TempDir::new("empty");
    let err = WeightFiles::open(&dir.0).unwrap_err();
    assert!(
        err.message
            .contains("contains neither model.safetensors nor"),
        "{}",
        err.message
    );
    let err = WeightFiles::open(&dir.path("nope")).unwrap_err();
    assert!(
        err.message.contains("does not exist or is not a directory"),
        "{}",
        err.message
    );
    let err = WeightFiles::open_file(&dir.path("nope.safetensors")).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Io);
    assert!(err.message.contains("nope.safetensors"), "{}", err.message);
}

// ---- valid files --------------------------------------------------------

/// A file with an I8 tensor of 1 byte first, so the F32 tensor after it
/// starts at data offset 1 and (header padded to 8) at file offset 8+n+1.
fn misaligned_file(values: &[f32]) -> Vec<u8> {
    let header = format!(
        r#"{{"__metadata__": {{"format": "pt"}}, "flag": {}, "w": {}}}"#,
        entry("I8", &[1], 0, 1),
        entry("F32", &[values.len()], 1, 1 + 4 * values.len())
    );
    let mut data = vec![0xF9u8]; // -7 as i8
    data.extend(f32_bytes(values));
    raw_file(&header, &data)
}

#[test]
fn misaligned_f32_is_copied_correctly() {
    let values = [0.25f32, -1.5, 1e-20, f32::MAX, 7.0];
    let dir = TempDir::new("misaligned");
    dir.write(SINGLE_FILE, &misaligned_file(&values));
    let files = WeightFiles::open(&dir.0).unwrap();
    let w = files.require("w", &[5]).unwrap();
    assert_eq!(w.dtype, DType::F32);
    assert_ne!(
        w.bytes.as_ptr() as usize % 4,
        0,
        "test file should place w misaligned"
    );
    let got = w.to_f32().unwrap();
    assert!(
        matches!(got, Cow::Owned(_)),
        "misaligned data must be copied"
    );
    assert_eq!(got.as_ref(), values);
    assert_eq!(files.get("flag").unwrap().as_i8().unwrap().as_ref(), [-7]);
    assert_eq!(
        files.metadata().get("format").map(String::as_str),
        Some("pt")
    );
}

#[test]
fn hand_written_aligned_file_is_zero_copy() {
    let values = [1.0f32, 2.0, 3.0];
    let header = format!(r#"{{"w": {}}}"#, entry("F32", &[3], 0, 12));
    let dir = TempDir::new("aligned");
    dir.write(SINGLE_FILE, &raw_file(&header, &f32_bytes(&values)));
    let files = WeightFiles::open(&dir.0).unwrap();
    let got = files.get("w").unwrap().to_f32().unwrap();
    assert!(matches!(got, Cow::Borrowed(v) if v == values));
}

#[test]
fn round_trip_all_supported_dtypes() {
    let dir = TempDir::new("roundtrip");
    let path = dir.path(SINGLE_FILE);
    let f32s: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let halfs: Vec<f32> = vec![0.5, -2.0, 1024.0, 0.125, -0.0, 3.0];
    let i8s: Vec<i8> = vec![-128, -1, 0, 1, 127];
    let i32s: Vec<i32> = vec![i32::MIN, -5, 0, 99, i32::MAX, 1 << 20];
    let f32_b = f32_bytes(&f32s);
    let f16_b: Vec<u8> = halfs
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let bf16_b: Vec<u8> = halfs
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    let i8_b: Vec<u8> = i8s.iter().map(|&v| v as u8).collect();
    let i32_b: Vec<u8> = i32s.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = vec![
        (
            "model.embed",
            StView::new(StDtype::F32, vec![4, 6], &f32_b).unwrap(),
        ),
        (
            "h.f16",
            StView::new(StDtype::F16, vec![2, 3], &f16_b).unwrap(),
        ),
        (
            "h.bf16",
            StView::new(StDtype::BF16, vec![6], &bf16_b).unwrap(),
        ),
        ("q.i8", StView::new(StDtype::I8, vec![5], &i8_b).unwrap()),
        (
            "q.i32",
            StView::new(StDtype::I32, vec![3, 2], &i32_b).unwrap(),
        ),
        (
            "scalar",
            StView::new(StDtype::F32, vec![], &f32_b[..4]).unwrap(),
        ),
        ("empty", StView::new(StDtype::F32, vec![0, 7], &[]).unwrap()),
    ];
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(meta), &path).unwrap();

    let files = WeightFiles::open(&dir.0).unwrap();
    assert_eq!(files.len(), 7);
    let names: Vec<&str> = files.tensor_names().collect();
    assert_eq!(
        names,
        [
            "empty",
            "h.bf16",
            "h.f16",
            "model.embed",
            "q.i32",
            "q.i8",
            "scalar"
        ]
    );
    assert_eq!(files.metadata()["format"], "pt");
    assert_eq!(files.shards().len(), 1);
    assert_eq!(files.shards()[0].path(), path);

    let embed = files.require("model.embed", &[4, 6]).unwrap();
    assert_eq!(
        (embed.name, embed.dtype, embed.numel()),
        ("model.embed", DType::F32, 24)
    );
    let got = embed.to_f32().unwrap();
    assert!(
        matches!(got, Cow::Borrowed(_)),
        "aligned F32 should be zero-copy"
    );
    assert_eq!(got.as_ref(), f32s);

    let f16v = files.require("h.f16", &[2, 3]).unwrap();
    assert_eq!(f16v.to_f32().unwrap().as_ref(), halfs);
    assert!(matches!(f16v.as_u16().unwrap(), Cow::Borrowed(_)));
    assert_eq!(
        files
            .require("h.bf16", &[6])
            .unwrap()
            .to_f32()
            .unwrap()
            .as_ref(),
        halfs
    );
    assert_eq!(
        files
            .require("q.i8", &[5])
            .unwrap()
            .as_i8()
            .unwrap()
            .as_ref(),
        i8s
    );
    let i32v = files.require("q.i32", &[3, 2]).unwrap().as_i32().unwrap();
    assert!(matches!(i32v, Cow::Borrowed(_)));
    assert_eq!(i32v.as_ref(), i32s);
    assert_eq!(
        files
            .require("scalar", &[])
            .unwrap()
            .to_f32()
            .unwrap()
            .as_ref(),
        [-3.0]
    );
    assert!(files
        .require("empty", &[0, 7])
        .unwrap()
        .to_f32()
        .unwrap()
        .is_empty());

    // Wrong type requests are errors, not reinterpretations.
    let err = files.get("q.i8").unwrap().to_f32().unwrap_err();
    assert!(
        err.message
            .contains("tensor 'q.i8' has dtype I8, expected F32, F16 or BF16"),
        "{}",
        err.message
    );
    files.finish_loading();
}

#[test]
fn require_names_file_tensor_and_shapes() {
    let dir = TempDir::new("require");
    let path = dir.write(SINGLE_FILE, &misaligned_file(&[1.0, 2.0]));
    let files = WeightFiles::open(&dir.0).unwrap();
    let err = files.require("w", &[3]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidModel);
    assert_eq!(
        err.message,
        format!("{}: tensor 'w' has shape [2], expected [3]", path.display())
    );
    let err = files.require("missing.weight", &[2]).unwrap_err();
    assert_eq!(
        err.message,
        format!("tensor 'missing.weight' not found in {}", path.display())
    );
    assert!(files.get("missing.weight").is_none());
    assert!(!files.contains("missing.weight"));
}

#[test]
fn unsupported_dtype_is_validated_but_not_served() {
    let header = format!(
        r#"{{"ids": {}, "w": {}}}"#,
        entry("I64", &[2], 0, 16),
        entry("F32", &[1], 16, 20)
    );
    let mut data = vec![0u8; 16];
    data.extend(f32_bytes(&[4.0]));
    let dir = TempDir::new("unsupported");
    dir.write(SINGLE_FILE, &raw_file(&header, &data));
    let files = WeightFiles::open(&dir.0).unwrap();
    assert!(files.contains("ids"));
    assert!(files.get("ids").is_none());
    assert!(files.get_mapped("ids").is_none());
    let info = files.info("ids").unwrap();
    assert_eq!(
        (info.dtype, info.shape, info.byte_len),
        (SafetensorsDType::I64, &[2usize][..], 16)
    );
    let err = files.require("ids", &[2]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported);
    assert!(
        err.message.contains("tensor 'ids' has dtype I64"),
        "{}",
        err.message
    );
    assert_eq!(
        files.require("w", &[1]).unwrap().to_f32().unwrap().as_ref(),
        [4.0]
    );
}

#[test]
fn mapped_tensor_outlives_weight_files() {
    let dir = TempDir::new("outlive");
    dir.write(SINGLE_FILE, &misaligned_file(&[5.0, 6.0]));
    let files = WeightFiles::open(&dir.0).unwrap();
    let mapped = files.get_mapped("w").unwrap();
    drop(files);
    drop(dir); // the file is unlinked; the mapping stays valid
    let view = mapped.view();
    assert_eq!((view.name, view.shape), ("w", &[2usize][..]));
    assert_eq!(view.to_f32().unwrap().as_ref(), [5.0, 6.0]);
}

// ---- sharded models -----------------------------------------------------

/// Writes a shard holding one F32 tensor of `[2]` per name, valued by position.
fn write_shard(dir: &TempDir, file: &str, names: &[&str]) {
    let data: Vec<Vec<u8>> = names
        .iter()
        .enumerate()
        .map(|(i, _)| f32_bytes(&[i as f32, -(i as f32)]))
        .collect();
    let views: Vec<(&str, StView)> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| (*n, StView::new(StDtype::F32, vec![2], d).unwrap()))
        .collect();
    let meta = HashMap::from([("shard".to_string(), file.to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &dir.path(file)).unwrap();
}

fn write_index(dir: &TempDir, map: &[(&str, &str)]) -> PathBuf {
    let entries: Vec<String> = map
        .iter()
        .map(|(t, f)| format!("\"{t}\": \"{f}\""))
        .collect();
    let json = format!(
        r#"{{"metadata": {{"total_size": 32}}, "weight_map": {{{}}}}}"#,
        entries.join(", ")
    );
    dir.write(INDEX_FILE, json.as_bytes())
}

const SHARD_A: &str = "model-00001-of-00002.safetensors";
const SHARD_B: &str = "model-00002-of-00002.safetensors";

fn index_err(dir: &TempDir) -> Error {
    let err = WeightFiles::open(&dir.0).expect_err("inconsistent sharded model should be rejected");
    assert_eq!(err.kind, ErrorKind::InvalidModel, "{}", err.message);
    err
}

#[test]
fn sharded_model_loads_all_shards() {
    let dir = TempDir::new("sharded");
    write_shard(&dir, SHARD_A, &["a.0", "a.1"]);
    write_shard(&dir, SHARD_B, &["b.0"]);
    write_index(
        &dir,
        &[("a.0", SHARD_A), ("a.1", SHARD_A), ("b.0", SHARD_B)],
    );
    let files = WeightFiles::open(&dir.0).unwrap();
    assert_eq!(
        files.tensor_names().collect::<Vec<_>>(),
        ["a.0", "a.1", "b.0"]
    );
    assert_eq!(files.shards().len(), 2);
    assert_eq!(files.shards()[1].metadata()["shard"], SHARD_B);
    // Merged metadata: the first shard by name wins conflicts.
    assert_eq!(files.metadata()["shard"], SHARD_A);
    assert_eq!(
        files
            .require("a.1", &[2])
            .unwrap()
            .to_f32()
            .unwrap()
            .as_ref(),
        [1.0, -1.0]
    );
    let b0 = files.require("b.0", &[2]).unwrap();
    assert!(b0.file.ends_with(SHARD_B));
    assert_eq!(b0.to_f32().unwrap().as_ref(), [0.0, -0.0]);
    let err = files.require("c", &[2]).unwrap_err();
    assert!(err.message.contains(INDEX_FILE), "{}", err.message);
}

#[test]
fn sharded_missing_shard_file() {
    let dir = TempDir::new("noshard");
    write_shard(&dir, SHARD_A, &["a.0"]);
    write_index(&dir, &[("a.0", SHARD_A), ("b.0", SHARD_B)]);
    let msg = index_err(&dir).message;
    assert!(
        msg.contains(&format!(
            "shard file {} does not exist",
            dir.path(SHARD_B).display()
        )),
        "{msg}"
    );
}

#[test]
fn sharded_tensor_in_two_shards() {
    let dir = TempDir::new("twice");
    write_shard(&dir, SHARD_A, &["a.0", "shared"]);
    write_shard(&dir, SHARD_B, &["b.0", "shared"]);
    write_index(
        &dir,
        &[("a.0", SHARD_A), ("b.0", SHARD_B), ("shared", SHARD_A)],
    );
    let msg = index_err(&dir).message;
    assert!(msg.contains("tensor 'shared' appears in both"), "{msg}");
    assert!(msg.contains(SHARD_A) && msg.contains(SHARD_B), "{msg}");
}

#[test]
fn sharded_tensor_mapped_to_other_shard() {
    let dir = TempDir::new("elsewhere");
    write_shard(&dir, SHARD_A, &["a.0", "moved"]);
    write_shard(&dir, SHARD_B, &["b.0"]);
    write_index(
        &dir,
        &[("a.0", SHARD_A), ("b.0", SHARD_B), ("moved", SHARD_B)],
    );
    let msg = index_err(&dir).message;
    assert!(
        msg.contains("tensor 'moved' is in this shard, but the index")
            && msg.contains(&format!("maps it to '{SHARD_B}'")),
        "{msg}"
    );
}

#[test]
fn sharded_index_names_tensor_shard_lacks() {
    let dir = TempDir::new("lacks");
    write_shard(&dir, SHARD_A, &["a.0"]);
    write_shard(&dir, SHARD_B, &["b.0"]);
    write_index(
        &dir,
        &[("a.0", SHARD_A), ("b.0", SHARD_B), ("ghost", SHARD_B)],
    );
    let msg = index_err(&dir).message;
    assert!(
        msg.contains(&format!(
            "maps tensor 'ghost' to shard '{SHARD_B}', which does not contain it"
        )),
        "{msg}"
    );
}

#[test]
fn sharded_tensor_not_in_index() {
    let dir = TempDir::new("unlisted");
    write_shard(&dir, SHARD_A, &["a.0", "stray"]);
    write_index(&dir, &[("a.0", SHARD_A)]);
    let msg = index_err(&dir).message;
    assert!(
        msg.contains("tensor 'stray' is not listed in the index"),
        "{msg}"
    );
}

#[test]
fn sharded_index_malformed() {
    let dir = TempDir::new("badindex");
    write_shard(&dir, SHARD_A, &["a.0"]);
    let cases: [(&str, &str); 7] = [
        (
            r#"{"weight_map": {"a.0": "x", "a.0": "y"}}"#,
            "tensor 'a.0' is listed twice in 'weight_map'",
        ),
        (r#"{"metadata": {}}"#, "index has no 'weight_map'"),
        (
            r#"{"weight_map": []}"#,
            "'weight_map' must be an object, found an array",
        ),
        (
            r#"{"weight_map": {"a.0": 3}}"#,
            "'weight_map' entry for 'a.0' must be a file name, found a number",
        ),
        (
            r#"{"weight_map": {"a.0": "../model.safetensors"}}"#,
            "not a relative path inside the model directory",
        ),
        (
            r#"{"weight_map": {"a.0": "/etc/passwd"}}"#,
            "not a relative path inside the model directory",
        ),
        (r#"{"weight_map": "#, "index is not valid JSON"),
    ];
    for (json, needle) in cases {
        let path = dir.write(INDEX_FILE, json.as_bytes());
        let msg = index_err(&dir).message;
        assert!(msg.contains(needle), "expected '{needle}' in: {msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
    }
}

#[test]
fn sharded_bad_shard_is_reported_by_path() {
    let dir = TempDir::new("badshard");
    write_shard(&dir, SHARD_A, &["a.0"]);
    dir.write(SHARD_B, &[0, 1, 2]);
    write_index(&dir, &[("a.0", SHARD_A), ("b.0", SHARD_B)]);
    let msg = index_err(&dir).message;
    assert!(
        msg.contains(&format!("{}: file is 3 bytes", dir.path(SHARD_B).display())),
        "{msg}"
    );
}

// ---- robustness: no panics on arbitrary damage --------------------------

fn reads_everything(files: &WeightFiles) {
    for name in files.tensor_names() {
        if let Some(v) = files.get(name) {
            let n = v.numel();
            match v.dtype {
                DType::F32 | DType::F16 | DType::BF16 => assert_eq!(v.to_f32().unwrap().len(), n),
                DType::I8 => assert_eq!(v.as_i8().unwrap().len(), n),
                DType::I32 => assert_eq!(v.as_i32().unwrap().len(), n),
                DType::F8E4M3 => assert_eq!(v.as_e4m3().unwrap().len(), n),
            }
        }
    }
}

#[test]
fn every_truncation_is_rejected() {
    let full = misaligned_file(&[1.0, 2.0, 3.0]);
    let dir = TempDir::new("truncations");
    for len in 0..full.len() {
        dir.write(SINGLE_FILE, &full[..len]);
        let err = WeightFiles::open(&dir.0).expect_err("truncated file accepted");
        assert_eq!(
            err.kind,
            ErrorKind::InvalidModel,
            "len {len}: {}",
            err.message
        );
    }
    dir.write(SINGLE_FILE, &full);
    reads_everything(&WeightFiles::open(&dir.0).unwrap());
}

#[test]
fn damaged_headers_never_panic() {
    let full = misaligned_file(&[1.0, 2.0, 3.0]);
    let header_end = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    let dir = TempDir::new("damage");
    let mut accepted = 0;
    for pos in 0..header_end {
        for byte in [b'0', b'9', b'"', b'{', b'}', b',', 0xFF, b' ', b'-'] {
            let mut bytes = full.clone();
            bytes[pos] = byte;
            dir.write(SINGLE_FILE, &bytes);
            if let Ok(files) = WeightFiles::open(&dir.0) {
                accepted += 1;
                reads_everything(&files);
            }
        }
    }
    // Some edits are harmless (whitespace, digits in metadata values).
    assert!(accepted > 0);
}
