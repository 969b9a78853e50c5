//! The kernels (`kernels/*.cu`, one module per source, with the shared
//! helpers of `kernels/*.cuh`, embedded in the library), compiled by NVRTC
//! for the device's architecture on first use and cached on disk as PTX.
//! Cache key: source hash + activation dtype + arch + NVRTC version, so a
//! changed source, GPU or toolkit never loads a stale module.

use super::{cuda_error, ActDType};
use crate::{Error, ErrorKind, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};
use std::path::PathBuf;
use std::sync::Arc;

/// The kernel sources, each compiled on its own into a module
/// (scripts/check_kernels.py reads this list).
const MODULES: [(&str, &str); 4] = [
    ("decoder.cu", include_str!("../../../kernels/decoder.cu")),
    ("int4.cu", include_str!("../../../kernels/int4.cu")),
    (
        "int4_gemm.cu",
        include_str!("../../../kernels/int4_gemm.cu"),
    ),
    ("sampling.cu", include_str!("../../../kernels/sampling.cu")),
];

/// The headers the sources include (`#include "name"`), resolved here so
/// NVRTC needs no files at run time.
const HEADERS: [(&str, &str); 2] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("int4.cuh", include_str!("../../../kernels/int4.cuh")),
];

/// `source` with each `#include "name"` line replaced by that header (the
/// headers' include guards keep a header included twice harmless).
fn expand_includes(name: &str, source: &str) -> Result<String> {
    let mut out = String::with_capacity(source.len() + 32 * 1024);
    for line in source.lines() {
        let included = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'));
        match included {
            Some(header) => {
                let (_, text) = HEADERS.iter().find(|(h, _)| *h == header).ok_or_else(|| {
                    Error::new(
                        ErrorKind::Internal,
                        format!("kernels/{name} includes {header}, which is not embedded"),
                    )
                })?;
                out.push_str(text);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    Ok(out)
}

/// Where compiled modules are kept: `NANOINFER_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/nanoinfer/kernels`, else `~/.cache/nanoinfer/kernels`;
/// `NANOINFER_KERNEL_CACHE=off` disables it.
pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    pub fn from_env() -> Self {
        let dir = match crate::tuning::var("NANOINFER_KERNEL_CACHE") {
            Some(v) if v == "off" => None,
            Some(v) => Some(PathBuf::from(v)),
            None => std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|d| d.join("nanoinfer").join("kernels")),
        };
        KernelCache { dir }
    }

    fn path(&self, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.ptx")))
    }

    fn load(&self, key: &str) -> Option<String> {
        std::fs::read_to_string(self.path(key)?).ok()
    }

    /// Best effort: a read-only or full disk only costs a recompile next time.
    fn store(&self, key: &str, ptx: &str) {
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.path(key)) else {
            return;
        };
        if std::fs::create_dir_all(dir).is_err() {
            return;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
}

/// FNV-1a: a hash that is stable across Rust releases, for cache keys.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; the library
    // was found loadable by `check_libraries` before this runs.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// Tuning overrides of the kernels' compile-time constants, for
/// experiments: `NANOINFER_CUDA_GEMV_PREFETCH=BYTES` (how much of each
/// weight row a GEMV warp prefetches into L2 before it starts) and
/// `NANOINFER_CUDA_DEFINES="-DNAME=VALUE ..."` (any `#ifndef` constant of
/// the kernels, e.g. `W4_RING_2_1`, `W4_BLOCKS_1_1`).
fn tuning_defines() -> Vec<String> {
    let prefetch = crate::tuning::var("NANOINFER_CUDA_GEMV_PREFETCH")
        .and_then(|v| v.parse::<u32>().ok())
        .map(|bytes| format!("-DGEMV_PREFETCH_BYTES={bytes}"));
    let extra = crate::tuning::var("NANOINFER_CUDA_DEFINES").unwrap_or_default();
    prefetch
        .into_iter()
        .chain(
            extra
                .split_whitespace()
                .filter(|d| d.starts_with("-D"))
                .map(str::to_string),
        )
        .collect()
}

/// The NVRTC target of a compute capability: sm_90 compiles for `90a`,
/// whose wgmma instructions the int4 GEMM needs (PTX for `90a` loads on
/// sm_90 devices only, which is what it is compiled for).
fn target(arch: (i32, i32)) -> String {
    let suffix = if arch == (9, 0) { "a" } else { "" };
    format!("{}{}{suffix}", arch.0, arch.1)
}

fn compile(
    name: &str,
    source: &str,
    arch: (i32, i32),
    act: ActDType,
    defines: &[String],
) -> Result<String> {
    let mut options = vec![
        format!("--gpu-architecture=compute_{}", target(arch)),
        format!("-DNI_F16={}", (act == ActDType::F16) as i32),
    ];
    options.extend_from_slice(defines);
    let opts = CompileOptions {
        options,
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(source, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { log, .. }) => Err(Error::new(
            ErrorKind::Internal,
            format!(
                "NVRTC failed to compile kernels/{name} for sm_{}:\n{}",
                target(arch),
                log.to_string_lossy()
            ),
        )),
        Err(e) => Err(cuda_error("NVRTC", e)),
    }
}

/// One kernel of the module, with its name for errors and profiles.
pub struct Kernel {
    pub name: &'static str,
    pub func: CudaFunction,
}

impl Kernel {
    /// Whether it requests its inputs before `grid_dep_wait` (the int4
    /// products and the one-row plain GEMV their weights, decode attention
    /// the cached keys and values), so launching it while the previous
    /// kernel drains pays off. The fused QKV and gate/up GEMVs do too but
    /// are left out: launched early they lose (see `EarlyLaunch`).
    pub fn prefetches_before_wait(&self) -> bool {
        self.name.starts_with("w4_mm_")
            || self.name.starts_with("attention_decode_mma")
            || self.name == "gemv_r1"
    }
}

macro_rules! kernel_set {
    ($($name:ident),* $(,)?) => {
        /// Handles to every kernel of the modules.
        pub struct Kernels {
            $(pub $name: Kernel,)*
        }

        impl Kernels {
            /// Every kernel's name, as the sources define it.
            pub const NAMES: &[&str] = &[$(stringify!($name)),*];

            fn from_modules(modules: &[Arc<cudarc::driver::CudaModule>]) -> Result<Kernels> {
                Ok(Kernels {
                    $($name: Kernel {
                        name: stringify!($name),
                        func: find_function(modules, stringify!($name))?,
                    },)*
                })
            }
        }
    };
}

kernel_set!(
    embed,
    add_rms_norm,
    head_rms_norm,
    add_bias,
    rope_table,
    rope,
    silu_mul,
    kv_write,
    kv_write_fp8,
    attention,
    attention_fp8,
    attn_merge,
    kv_copy_slots,
    gemv,
    gemv_r1,
    gemv_swiglu,
    gemv_swiglu_r1,
    gemv_qkv_rope,
    gemv_qkv_rope_r1,
    gemv_f8,
    gemv_f8_r1,
    gemv_swiglu_f8,
    gemv_swiglu_f8_r1,
    gemv_qkv_rope_f8,
    gemv_qkv_rope_f8_r1,
    fp8_dequant,
    attention_tiles,
    attention_tiles_fp8,
    attention_flash,
    attention_flash_fp8,
    attention_decode_mma,
    attention_decode_mma_fp8,
    argmax_partial,
    argmax_merge,
    w4_mm_t1_n1,
    w4_mm_t1_n2,
    w4_mm_t1_n4,
    w4_mm_t2_n1,
    w4_mm_t2_n2,
    w4_mm_t2_n4,
    w4_mm_t1_n1_w4,
    w4_mm_t1_n2_w4,
    w4_mm_t1_n4_w4,
    w4_mm_t2_n1_w4,
    w4_mm_t2_n2_w4,
    w4_mm_t2_n4_w4,
    w4_mm_t1_n1_w2,
    w4_mm_t1_n2_w2,
    w4_mm_t1_n4_w2,
    w4_mm_t2_n1_w2,
    w4_mm_t2_n2_w2,
    w4_mm_t2_n4_w2,
    w4_mm_t2_n1_norm,
    w4_dequant,
    w4_gather,
    w4_gemm_pack_x,
    add_rms_norm_w4g,
    silu_mul_w4g,
    w4_gemm_wg2,
    w4_gemm_wg4,
    w4_gemm_wg2_t256,
    sample_rows,
);

/// Kernel `name` from the module that defines it.
fn find_function(modules: &[Arc<cudarc::driver::CudaModule>], name: &str) -> Result<CudaFunction> {
    let mut last = None;
    for m in modules {
        match m.load_function(name) {
            Ok(f) => return Ok(f),
            Err(e) => last = Some(e),
        }
    }
    Err(cuda_error(&format!("loading kernel {name}"), last))
}

impl Kernels {
    pub fn load(
        ctx: &Arc<CudaContext>,
        arch: (i32, i32),
        act: ActDType,
        cache: &KernelCache,
    ) -> Result<Kernels> {
        let nvrtc = nvrtc_version();
        let defines = tuning_defines();
        let mut modules = Vec::with_capacity(MODULES.len());
        for (name, source) in MODULES {
            let source = expand_includes(name, source)?;
            let key = format!(
                "{}-{:016x}-{}-sm{}-nvrtc{}.{}{}",
                name.trim_end_matches(".cu"),
                fnv1a(source.as_bytes()),
                act.name(),
                target(arch),
                nvrtc.0,
                nvrtc.1,
                defines.concat()
            );
            let ptx = match cache.load(&key) {
                Some(ptx) => ptx,
                None => {
                    let ptx = compile(name, &source, arch, act, &defines)?;
                    cache.store(&key, &ptx);
                    ptx
                }
            };
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| cuda_error(&format!("loading the module of kernels/{name}"), e))?;
            modules.push(module);
        }
        Kernels::from_modules(&modules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every include of every source resolves (scripts/check_kernels.py
    /// checks that each kernel is defined by exactly one module).
    #[test]
    fn every_include_resolves() {
        for (name, source) in MODULES {
            let expanded = expand_includes(name, source).unwrap();
            assert!(!expanded.contains("#include \""), "{name}");
        }
        let err = expand_includes("x.cu", "#include \"missing.cuh\"\n").unwrap_err();
        assert!(err.message.contains("missing.cuh"), "{}", err.message);
    }

    #[test]
    fn cache_keys_are_stable() {
        assert_eq!(fnv1a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(b"a"), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn cache_round_trips_and_can_be_disabled() {
        let dir = std::env::temp_dir().join(format!("ni-kcache-{}", std::process::id()));
        let cache = KernelCache {
            dir: Some(dir.clone()),
        };
        assert!(cache.load("k").is_none());
        cache.store("k", "ptx text");
        assert_eq!(cache.load("k").as_deref(), Some("ptx text"));
        std::fs::remove_dir_all(&dir).unwrap();
        let off = KernelCache { dir: None };
        off.store("k", "x");
        assert!(off.load("k").is_none());
    }
}
