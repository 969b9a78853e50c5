//! Parsing and validation of one safetensors header against the size of the
//! data section that follows it. Pure: no I/O, every error names the file.
//!
//! Layout: `u64` little-endian header length `n`, `n` bytes of UTF-8 JSON,
//! then the data section. The JSON object maps tensor names to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to
//! the data section) plus an optional `"__metadata__"` string→string map.
//! The tensors must tile the data section exactly: no overlaps, no gaps, no
//! trailing bytes (as the reference implementation requires).

use std::collections::HashMap;
use std::path::Path;

use super::safetensors_json::{first_duplicate_key, Json};
use crate::tensor::dtype::SafetensorsDType;
use crate::{bail_model, Error, Result};

/// Bytes holding the header length at the start of the file.
pub(crate) const HEADER_LEN_BYTES: usize = 8;
/// Largest header accepted (the reference implementation's limit).
pub(crate) const MAX_HEADER_BYTES: u64 = 100_000_000;

const METADATA_KEY: &str = "__metadata__";

/// One validated tensor entry. Offsets are relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeaderTensor {
    pub name: String,
    pub dtype: SafetensorsDType,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub metadata: HashMap<String, String>,
    /// Sorted by data offset.
    pub tensors: Vec<HeaderTensor>,
}

/// Parses the header JSON and checks every entry against a data section of
/// `data_len` bytes.
pub(crate) fn parse_header(json: &[u8], data_len: usize, file: &Path) -> Result<Header> {
    let f = file.display();
    let root =
        Json::parse(json).map_err(|e| Error::invalid_model(format!("{f}: header is {e}")))?;
    let Json::Object(entries) = root else {
        bail_model!("{f}: header must be a JSON object, found {}", root.kind());
    };
    if let Some(dup) = first_duplicate_key(&entries) {
        if dup == METADATA_KEY {
            bail_model!("{f}: header has two '{METADATA_KEY}' entries");
        }
        bail_model!("{f}: duplicate tensor name '{dup}' in header");
    }

    let mut metadata = HashMap::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == METADATA_KEY {
            metadata = parse_metadata(value, file)?;
        } else {
            tensors.push(parse_tensor(name, value, data_len, file)?);
        }
    }
    check_tiling(&mut tensors, data_len, file)?;
    Ok(Header { metadata, tensors })
}

fn parse_metadata(value: Json, file: &Path) -> Result<HashMap<String, String>> {
    let f = file.display();
    let Json::Object(entries) = value else {
        bail_model!(
            "{f}: '{METADATA_KEY}' must be an object of string values, found {}",
            value.kind()
        );
    };
    if let Some(dup) = first_duplicate_key(&entries) {
        bail_model!("{f}: duplicate key '{dup}' in '{METADATA_KEY}'");
    }
    entries
        .into_iter()
        .map(|(key, value)| match value {
            Json::String(s) => Ok((key, s)),
            other => Err(Error::invalid_model(format!(
                "{f}: '{METADATA_KEY}' value for key '{key}' must be a string, found {}",
                other.kind()
            ))),
        })
        .collect()
}

fn parse_tensor(name: String, value: Json, data_len: usize, file: &Path) -> Result<HeaderTensor> {
    let f = file.display();
    if name.is_empty() {
        bail_model!("{f}: header has a tensor with an empty name");
    }
    let Json::Object(fields) = value else {
        bail_model!(
            "{f}: tensor '{name}': entry must be an object, found {}",
            value.kind()
        );
    };
    if let Some(dup) = first_duplicate_key(&fields) {
        bail_model!("{f}: tensor '{name}': duplicate field '{dup}'");
    }
    let field = |key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                Error::invalid_model(format!("{f}: tensor '{name}': missing field '{key}'"))
            })
    };

    let dtype = match field("dtype")? {
        Json::String(tag) => SafetensorsDType::from_tag(tag).ok_or_else(|| {
            Error::invalid_model(format!("{f}: tensor '{name}': unknown dtype '{tag}'"))
        })?,
        other => bail_model!(
            "{f}: tensor '{name}': 'dtype' must be a string, found {}",
            other.kind()
        ),
    };
    let shape = usize_array(field("shape")?).ok_or_else(|| {
        Error::invalid_model(format!(
            "{f}: tensor '{name}': 'shape' must be an array of non-negative integers"
        ))
    })?;
    let (begin, end) = match usize_array(field("data_offsets")?).as_deref() {
        Some(&[begin, end]) => (begin, end),
        _ => bail_model!(
            "{f}: tensor '{name}': 'data_offsets' must be an array of two non-negative integers"
        ),
    };

    let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let Some(numel) = numel else {
        bail_model!("{f}: tensor '{name}': element count of shape {shape:?} overflows");
    };
    let Some(bytes) = dtype.byte_size(numel) else {
        if numel.checked_mul(dtype.bits()).is_none() {
            bail_model!(
                "{f}: tensor '{name}': byte size of shape {shape:?} with dtype {dtype} overflows"
            );
        }
        bail_model!(
            "{f}: tensor '{name}': shape {shape:?} with dtype {dtype} is not a whole number of bytes"
        );
    };
    if begin > end {
        bail_model!("{f}: tensor '{name}': data_offsets [{begin}, {end}] have begin after end");
    }
    if end - begin != bytes {
        bail_model!(
            "{f}: tensor '{name}': data_offsets [{begin}, {end}] span {} bytes, but shape {shape:?} \
             with dtype {dtype} needs {bytes}",
            end - begin
        );
    }
    if end > data_len {
        bail_model!(
            "{f}: tensor '{name}': data_offsets [{begin}, {end}] run past the end of the data \
             section ({data_len} bytes; is the file truncated?)"
        );
    }
    Ok(HeaderTensor {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

fn usize_array(value: &Json) -> Option<Vec<usize>> {
    match value {
        Json::Array(items) => items.iter().map(Json::as_usize).collect(),
        _ => None,
    }
}

/// Sorts by offset and checks that the tensors cover `[0, data_len)` exactly once.
fn check_tiling(tensors: &mut [HeaderTensor], data_len: usize, file: &Path) -> Result<()> {
    let f = file.display();
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut covered = 0usize;
    let mut last: Option<&HeaderTensor> = None;
    for t in tensors.iter() {
        if t.begin < covered {
            // `last` is set: `covered` > 0 only after a tensor.
            let prev = last.map_or("", |p| p.name.as_str());
            let (pb, pe) = last.map_or((0, 0), |p| (p.begin, p.end));
            bail_model!(
                "{f}: tensors '{prev}' [{pb}, {pe}] and '{}' [{}, {}] overlap",
                t.name,
                t.begin,
                t.end
            );
        }
        if t.begin > covered {
            bail_model!(
                "{f}: gap in the data section: bytes [{covered}, {}] before tensor '{}' belong to no tensor",
                t.begin,
                t.name
            );
        }
        covered = t.end;
        last = Some(t);
    }
    if covered < data_len {
        bail_model!(
            "{f}: {} trailing bytes after the last tensor (data section is {data_len} bytes, \
             tensors end at {covered})",
            data_len - covered
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data_len: usize) -> Result<Header> {
        parse_header(json.as_bytes(), data_len, Path::new("m.safetensors"))
    }

    fn err(json: &str, data_len: usize) -> String {
        let e = parse(json, data_len).expect_err("header should be rejected");
        assert_eq!(e.kind, crate::ErrorKind::InvalidModel, "{}", e.message);
        assert!(e.message.starts_with("m.safetensors: "), "{}", e.message);
        e.message
    }

    fn assert_err(json: &str, data_len: usize, needle: &str) {
        let msg = err(json, data_len);
        assert!(msg.contains(needle), "expected '{needle}' in: {msg}");
    }

    #[test]
    fn valid_header_sorted_by_offset_with_metadata() {
        let h = parse(
            r#"{"b": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]},
                "__metadata__": {"format": "pt"},
                "a": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]},
                "z": {"dtype": "F64", "shape": [0, 5], "data_offsets": [10, 10], "extra": 1}}   "#,
            10,
        )
        .unwrap();
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "z"]);
        assert_eq!(h.tensors[1].shape, [2]);
        assert_eq!((h.tensors[1].begin, h.tensors[1].end), (2, 10));
        assert_eq!(h.tensors[2].dtype, SafetensorsDType::F64);
        assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
        assert!(parse("{}", 0).unwrap().tensors.is_empty());
    }

    #[test]
    fn structural_errors() {
        assert_err("{\"a\": 1", 0, "header is not valid JSON");
        assert_err("[1, 2]", 0, "header must be a JSON object, found an array");
        assert_err("\"x\"", 0, "found a string");
        assert_err(
            r#"{"__metadata__": {}, "__metadata__": {}}"#,
            0,
            "two '__metadata__' entries",
        );
        let e = parse_header(b"{\"\xc3\x28\": 1}", 0, Path::new("m.safetensors")).unwrap_err();
        assert!(
            e.message.contains("header is not valid UTF-8"),
            "{}",
            e.message
        );
    }

    #[test]
    fn metadata_errors() {
        assert_err(
            r#"{"__metadata__": ["a"]}"#,
            0,
            "'__metadata__' must be an object of string values, found an array",
        );
        assert_err(r#"{"__metadata__": null}"#, 0, "found null");
        assert_err(
            r#"{"__metadata__": {"n": 3}}"#,
            0,
            "value for key 'n' must be a string, found a number",
        );
        assert_err(
            r#"{"__metadata__": {"k": "a", "k": "b"}}"#,
            0,
            "duplicate key 'k' in '__metadata__'",
        );
    }

    #[test]
    fn entry_field_errors() {
        let t = |body: &str| format!("{{\"w\": {body}}}");
        assert_err(
            &t("[1]"),
            0,
            "tensor 'w': entry must be an object, found an array",
        );
        assert_err(
            &t(r#"{"shape": [], "data_offsets": [0, 4]}"#),
            4,
            "tensor 'w': missing field 'dtype'",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "data_offsets": [0, 4]}"#),
            4,
            "tensor 'w': missing field 'shape'",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "shape": []}"#),
            4,
            "tensor 'w': missing field 'data_offsets'",
        );
        assert_err(
            &t(r#"{"dtype": 1, "shape": [], "data_offsets": [0, 4]}"#),
            4,
            "'dtype' must be a string",
        );
        assert_err(
            &t(r#"{"dtype": "Q4", "shape": [], "data_offsets": [0, 4]}"#),
            4,
            "tensor 'w': unknown dtype 'Q4'",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}"#),
            4,
            "'shape' must be an array of non-negative integers",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}"#),
            4,
            "'shape' must be",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "shape": [], "data_offsets": [0]}"#),
            4,
            "'data_offsets' must be an array of two",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "shape": [], "data_offsets": [0, 4, 8]}"#),
            4,
            "'data_offsets' must be an array of two",
        );
        assert_err(
            &t(r#"{"dtype": "F32", "dtype": "F16", "shape": [], "data_offsets": [0, 4]}"#),
            4,
            "tensor 'w': duplicate field 'dtype'",
        );
    }

    #[test]
    fn duplicate_and_empty_names() {
        let e = r#"{"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}"#;
        let f = r#"{"dtype": "I8", "shape": [1], "data_offsets": [1, 2]}"#;
        assert_err(
            &format!("{{\"w\": {e}, \"w\": {f}}}"),
            2,
            "duplicate tensor name 'w' in header",
        );
        assert_err(&format!("{{\"\": {e}}}"), 1, "tensor with an empty name");
    }

    #[test]
    fn size_and_overflow_errors() {
        let huge = usize::MAX / 2 + 1;
        assert_err(
            &format!(
                r#"{{"w": {{"dtype": "F32", "shape": [{huge}, 4], "data_offsets": [0, 4]}}}}"#
            ),
            4,
            "element count of shape",
        );
        assert_err(
            &format!(r#"{{"w": {{"dtype": "F32", "shape": [{huge}], "data_offsets": [0, 4]}}}}"#),
            4,
            "byte size of shape",
        );
        assert_err(
            r#"{"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}"#,
            2,
            "is not a whole number of bytes",
        );
        assert_err(
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#,
            8,
            "data_offsets [8, 0] have begin after end",
        );
        assert_err(
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}"#,
            12,
            "span 12 bytes, but shape [2] with dtype F32 needs 8",
        );
        assert_err(
            r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#,
            6,
            "run past the end of the data section (6 bytes",
        );
    }

    #[test]
    fn tiling_errors() {
        let two = |a: (usize, usize), b: (usize, usize)| {
            format!(
                r#"{{"a": {{"dtype": "I8", "shape": [{}], "data_offsets": [{}, {}]}},
                    "b": {{"dtype": "I8", "shape": [{}], "data_offsets": [{}, {}]}}}}"#,
                a.1 - a.0,
                a.0,
                a.1,
                b.1 - b.0,
                b.0,
                b.1
            )
        };
        assert_err(
            &two((0, 4), (2, 6)),
            6,
            "tensors 'a' [0, 4] and 'b' [2, 6] overlap",
        );
        assert_err(&two((0, 4), (0, 4)), 4, "overlap");
        assert_err(
            &two((0, 2), (4, 6)),
            6,
            "gap in the data section: bytes [2, 4] before tensor 'b'",
        );
        assert_err(&two((2, 4), (4, 6)), 6, "bytes [0, 2] before tensor 'a'");
        assert_err(
            &two((0, 2), (2, 4)),
            7,
            "3 trailing bytes after the last tensor",
        );
        assert_err("{}", 1, "1 trailing bytes");
        assert!(parse(&two((0, 2), (2, 4)), 4).is_ok());
    }
}
