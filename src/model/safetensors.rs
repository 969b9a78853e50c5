//! Strict safetensors reader over shared read-only memory maps.
//!
//! [`WeightFiles::open`] takes a model directory holding either a single
//! `model.safetensors` or a sharded `model.safetensors.index.json` whose
//! `weight_map` sends each tensor name to a shard file. Every header is read
//! with `pread` and fully validated before the file is mapped (see
//! `safetensors_header` for the rules); the index must agree exactly with the
//! shards' contents. Tensors are then served zero-copy from the maps.
//!
//! Views borrow the [`WeightFiles`]; [`WeightFiles::get_mapped`] returns a
//! [`MappedTensor`] that holds its map through an `Arc` and may outlive it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::{Advice, Mmap, MmapOptions};

use super::safetensors_header::{parse_header, Header, HEADER_LEN_BYTES, MAX_HEADER_BYTES};
use super::safetensors_json::{first_duplicate_key, Json};
pub use super::safetensors_view::{MappedTensor, TensorView};
use crate::tensor::dtype::SafetensorsDType;
use crate::{bail_model, untrusted_file, Error, ErrorKind, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped weight file.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
    metadata: HashMap<String, String>,
    /// Offset of the data section in the file.
    data_start: usize,
}

impl Shard {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's `__metadata__` map (empty when absent).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    pub fn file_len(&self) -> usize {
        self.map.len()
    }
}

/// What the header says about a tensor, whatever its dtype.
#[derive(Debug, Clone, Copy)]
pub struct TensorInfo<'a> {
    pub name: &'a str,
    pub file: &'a Path,
    pub dtype: SafetensorsDType,
    pub shape: &'a [usize],
    pub byte_len: usize,
}

#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: SafetensorsDType,
    shape: Vec<usize>,
    /// Absolute byte range in the shard's file.
    start: usize,
    end: usize,
}

/// The validated, mapped weight files of one model.
#[derive(Debug)]
pub struct WeightFiles {
    /// What the model was opened from (directory or file), for messages.
    source: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
    metadata: HashMap<String, String>,
}

impl WeightFiles {
    /// Opens `dir/model.safetensors` if present, else the shards listed by
    /// `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<WeightFiles> {
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            return Self::open_file(&single);
        }
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            return Self::open_index(&index);
        }
        if !dir.is_dir() {
            bail_model!(
                "model directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        bail_model!(
            "{} contains neither {SINGLE_FILE} nor {INDEX_FILE}",
            dir.display()
        )
    }

    /// Opens one safetensors file.
    pub fn open_file(path: &Path) -> Result<WeightFiles> {
        let (shard, header) = open_shard(path)?;
        let mut files = WeightFiles {
            source: path.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            metadata: shard.metadata.clone(),
        };
        files.add_shard(shard, header, |_| Ok(()))?;
        Ok(files)
    }

    /// Opens the shards named by a `model.safetensors.index.json` (paths in
    /// it are relative to the index's directory).
    pub fn open_index(index_path: &Path) -> Result<WeightFiles> {
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let weight_map = read_weight_map(index_path)?;
        let ix = index_path.display();

        let shard_names: BTreeSet<&str> = weight_map.values().map(String::as_str).collect();
        let mut files = WeightFiles {
            source: index_path.to_path_buf(),
            shards: Vec::with_capacity(shard_names.len()),
            tensors: BTreeMap::new(),
            metadata: HashMap::new(),
        };
        for shard_name in shard_names {
            let path = dir.join(shard_name);
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => {}
                Ok(_) => bail_model!("{ix}: shard {} is not a regular file", path.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bail_model!("{ix}: shard file {} does not exist", path.display())
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("cannot stat shard {}", path.display()),
                        e,
                    ))
                }
            }
            let (shard, header) = open_shard(&path)?;
            for (k, v) in &shard.metadata {
                files.metadata.entry(k.clone()).or_insert_with(|| v.clone());
            }
            let shard_path = shard.path.display().to_string();
            files.add_shard(shard, header, |name| match weight_map.get(name) {
                None => bail_model!("{shard_path}: tensor '{name}' is not listed in the index {ix}"),
                Some(mapped) if mapped != shard_name => bail_model!(
                    "{shard_path}: tensor '{name}' is in this shard, but the index {ix} maps it to '{mapped}'"
                ),
                Some(_) => Ok(()),
            })?;
        }
        for (name, shard_name) in &weight_map {
            if !files.tensors.contains_key(name) {
                bail_model!(
                    "{ix}: maps tensor '{name}' to shard '{shard_name}', which does not contain it"
                );
            }
        }
        Ok(files)
    }

    /// Registers a shard's tensors; `check` vets each name against an index.
    fn add_shard(
        &mut self,
        shard: Shard,
        header: Header,
        check: impl Fn(&str) -> Result<()>,
    ) -> Result<()> {
        let shard_ix = self.shards.len();
        for t in header.tensors {
            if let Some(prev) = self.tensors.get(&t.name) {
                bail_model!(
                    "tensor '{}' appears in both {} and {}",
                    t.name,
                    self.shards[prev.shard].path.display(),
                    shard.path.display()
                );
            }
            check(&t.name)?;
            let entry = Entry {
                shard: shard_ix,
                dtype: t.dtype,
                shape: t.shape,
                start: shard.data_start + t.begin,
                end: shard.data_start + t.end,
            };
            self.tensors.insert(t.name, entry);
        }
        self.shards.push(shard);
        Ok(())
    }

    /// A view of tensor `name`; `None` when it is absent or its dtype is one
    /// the engine does not support (see [`info`](Self::info) and
    /// [`require`](Self::require) to tell these apart).
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let (name, e) = self.tensors.get_key_value(name)?;
        let shard = &self.shards[e.shard];
        Some(TensorView {
            name,
            file: &shard.path,
            dtype: e.dtype.to_dtype()?,
            shape: &e.shape,
            bytes: &shard.map[e.start..e.end],
        })
    }

    /// Like [`get`](Self::get), but the result keeps the file mapped on its own.
    pub fn get_mapped(&self, name: &str) -> Option<MappedTensor> {
        let (name, e) = self.tensors.get_key_value(name)?;
        let shard = &self.shards[e.shard];
        Some(MappedTensor {
            name: name.clone(),
            file: shard.path.clone(),
            dtype: e.dtype.to_dtype()?,
            shape: e.shape.clone(),
            map: Arc::clone(&shard.map),
            start: e.start,
            end: e.end,
        })
    }

    /// Header information for any tensor, including unsupported dtypes.
    pub fn info(&self, name: &str) -> Option<TensorInfo<'_>> {
        let (name, e) = self.tensors.get_key_value(name)?;
        Some(TensorInfo {
            name,
            file: &self.shards[e.shard].path,
            dtype: e.dtype,
            shape: &e.shape,
            byte_len: e.end - e.start,
        })
    }

    /// Tensor `name`, which must exist, have a supported dtype, have
    /// exactly `expected_shape` and hold no NaN or infinity (every weight
    /// the loaders read comes through here).
    pub fn require(&self, name: &str, expected_shape: &[usize]) -> Result<TensorView<'_>> {
        let Some(info) = self.info(name) else {
            bail_model!("tensor '{name}' not found in {}", self.source.display());
        };
        let file = info.file.display();
        if info.shape != expected_shape {
            bail_model!(
                "{file}: tensor '{name}' has shape {:?}, expected {expected_shape:?}",
                info.shape
            );
        }
        let view = self.get(name).ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{file}: tensor '{name}' has dtype {}, which this build cannot use",
                    info.dtype
                ),
            )
        })?;
        view.check_finite()?;
        Ok(view)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// `__metadata__` of all shards merged; on conflicting values the shard
    /// whose file name sorts first wins (see [`shards`](Self::shards) for each).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The mapped files, sorted by file name.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Tells the kernel that loading is over: access becomes random (no more
    /// read-ahead). Hints that fail are ignored.
    pub fn finish_loading(&self) {
        for shard in &self.shards {
            let _ = shard.map.advise(Advice::Random);
        }
    }
}

/// Reads and validates a file's header, then maps the file.
fn open_shard(path: &Path) -> Result<(Shard, Header)> {
    let p = path.display();
    let file = untrusted_file::open(path)?;
    let file_len = file
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {p}"), e))?
        .len();
    if file_len < HEADER_LEN_BYTES as u64 {
        bail_model!("{p}: file is {file_len} bytes, too short to hold the 8-byte header length");
    }
    let mut len_bytes = [0u8; HEADER_LEN_BYTES];
    file.read_exact_at(&mut len_bytes, 0)
        .map_err(|e| Error::io(format!("cannot read {p}"), e))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        bail_model!("{p}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit");
    }
    if header_len > file_len - HEADER_LEN_BYTES as u64 {
        bail_model!(
            "{p}: header length {header_len} runs past the end of the file ({file_len} bytes)"
        );
    }
    let Ok(file_len) = usize::try_from(file_len) else {
        bail_model!("{p}: file of {file_len} bytes cannot be mapped on this platform");
    };
    let header_len = header_len as usize; // <= MAX_HEADER_BYTES
    advise_sequential(&file);
    let mut header_bytes = vec![0u8; header_len];
    file.read_exact_at(&mut header_bytes, HEADER_LEN_BYTES as u64)
        .map_err(|e| Error::io(format!("cannot read header of {p}"), e))?;
    let data_len = file_len - HEADER_LEN_BYTES - header_len;
    let header = parse_header(&header_bytes, data_len, path)?;

    let map = map_read_only(&file, path)?;
    if map.len() != file_len {
        bail_model!(
            "{p}: file changed size while being opened ({file_len} -> {} bytes)",
            map.len()
        );
    }
    let _ = map.advise(Advice::WillNeed);
    #[cfg(target_os = "linux")]
    let _ = map.advise(Advice::HugePage);
    let shard = Shard {
        path: path.to_path_buf(),
        map: Arc::new(map),
        metadata: header.metadata.clone(),
        data_start: HEADER_LEN_BYTES + header_len,
    };
    Ok((shard, header))
}

/// The one place that maps a file.
fn map_read_only(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: the file is opened read-only and mapped shared read-only, so
    // this process never writes through the map. The `&[u8]` it hands out
    // assumes the bytes do not change underneath: a weight file must not be
    // modified or truncated while loaded (by another process) — truncation
    // makes reads of the lost pages raise SIGBUS, rewrites show through. This
    // is the contract of every mmap-based loader; bounds were validated
    // against the length seen at open, which the caller re-checks.
    unsafe { MmapOptions::new().map(file) }
        .map_err(|e| Error::io(format!("cannot map {}", path.display()), e))
}

/// Read-ahead hint for the header read and the first pass over the weights.
fn advise_sequential(file: &File) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the fd is valid for the duration of the call (borrowed from
        // `file`); posix_fadvise only records a hint for it.
        let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = file;
}

/// Largest index file accepted; real ones are well under a megabyte.
const MAX_INDEX_BYTES: u64 = 100_000_000;

/// Parses the index's `weight_map` (tensor name → shard file name).
fn read_weight_map(index_path: &Path) -> Result<BTreeMap<String, String>> {
    let ix = index_path.display();
    let len = std::fs::metadata(index_path)
        .map_err(|e| Error::io(format!("cannot stat {ix}"), e))?
        .len();
    if len > MAX_INDEX_BYTES {
        bail_model!("{ix}: index file is {len} bytes, over the {MAX_INDEX_BYTES}-byte limit");
    }
    let bytes = untrusted_file::read(index_path, MAX_INDEX_BYTES)?;
    let root =
        Json::parse(&bytes).map_err(|e| Error::invalid_model(format!("{ix}: index is {e}")))?;
    let Json::Object(top) = root else {
        bail_model!("{ix}: index must be a JSON object, found {}", root.kind());
    };
    if let Some(dup) = first_duplicate_key(&top) {
        bail_model!("{ix}: index has two '{dup}' entries");
    }
    let Some((_, map)) = top.into_iter().find(|(k, _)| k == "weight_map") else {
        bail_model!("{ix}: index has no 'weight_map'");
    };
    let Json::Object(entries) = map else {
        bail_model!("{ix}: 'weight_map' must be an object, found {}", map.kind());
    };
    if let Some(dup) = first_duplicate_key(&entries) {
        bail_model!("{ix}: tensor '{dup}' is listed twice in 'weight_map'");
    }
    let mut weight_map = BTreeMap::new();
    for (name, value) in entries {
        let Json::String(shard) = value else {
            bail_model!(
                "{ix}: 'weight_map' entry for '{name}' must be a file name, found {}",
                value.kind()
            );
        };
        if name.is_empty() {
            bail_model!("{ix}: 'weight_map' has an empty tensor name");
        }
        let plain = Path::new(&shard)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
        if shard.is_empty() || !plain {
            bail_model!(
                "{ix}: 'weight_map' entry for '{name}' names shard '{shard}', which is not a \
                 relative path inside the model directory"
            );
        }
        weight_map.insert(name, shard);
    }
    Ok(weight_map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_can_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<WeightFiles>();
        send_sync::<MappedTensor>();
        send_sync::<TensorView<'static>>();
    }
}
