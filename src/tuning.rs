//! Every `NANOINFER_*` environment switch, in one table: its name, default
//! and one line of what it does. Code reads a switch only through [`var`],
//! which refuses names missing from the table, and `tests/tuning_switches.rs`
//! checks that the table, the code and `docs/tuning.md` (generated from the
//! table) agree, so a switch cannot be read, or documented, without being
//! listed here.
//!
//! Most switches keep an alternative code path alive for same-run
//! comparisons; docs/rejected-ideas.md gives the measurement each one lost.

/// Why a switch exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchKind {
    /// Where things go on this machine (a cache directory).
    Setting,
    /// A path that lost to the default, kept for comparisons.
    Comparison,
    /// A tuning constant for experiments.
    Tuning,
    /// Diagnostics and tests.
    Diagnostic,
}

impl SwitchKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SwitchKind::Setting => "setting",
            SwitchKind::Comparison => "comparison",
            SwitchKind::Tuning => "tuning",
            SwitchKind::Diagnostic => "diagnostic",
        }
    }
}

/// One environment switch.
#[derive(Debug, Clone, Copy)]
pub struct Switch {
    pub name: &'static str,
    pub kind: SwitchKind,
    /// What applies when the variable is unset.
    pub default: &'static str,
    pub doc: &'static str,
}

const fn switch(
    name: &'static str,
    kind: SwitchKind,
    default: &'static str,
    doc: &'static str,
) -> Switch {
    Switch {
        name,
        kind,
        default,
        doc,
    }
}

use SwitchKind::{Comparison, Diagnostic, Setting, Tuning};

/// The table, CPU first, then CUDA; sorted by name within each.
pub const SWITCHES: &[Switch] = &[
    switch("NANOINFER_AMX", Comparison, "on", "`0`: BF16 products without AMX tiles (f32 kernels)"),
    switch("NANOINFER_ATTN_SIMPLE", Comparison, "off", "set: the plain CPU attention instead of the blocked AVX-512/AVX2 kernels"),
    switch("NANOINFER_AVX512_BF16", Comparison, "on", "`0`: packed BF16 weights without `vdpbf16ps`"),
    switch("NANOINFER_BF16_ROUND_ACTS", Diagnostic, "off", "`1`: round activations to BF16 where AMX would, on any CPU (to measure AMX's numerics)"),
    switch("NANOINFER_ISA", Diagnostic, "the best the CPU has", "`avx512` (no BF16/VNNI/AMX extensions), `avx2`, `neon` (aarch64 without `sdot`) or `scalar`: force a CPU kernel path (the numeric tests run under each)"),
    switch("NANOINFER_TEST_HOOKS", Diagnostic, "off", "`1`: enable the testing hook `ni_debug_force_panic`"),
    switch("NANOINFER_CUDA_DECODE_MMA", Comparison, "on", "`0`: CUDA-core decode attention instead of the tensor-core kernel"),
    switch("NANOINFER_CUDA_DEFINES", Tuning, "none", "`-DNAME=VALUE ...`: override any `#ifndef` constant of the CUDA kernels"),
    switch("NANOINFER_CUDA_FLASH", Comparison, "on", "`0`: CUDA-core prefill attention tiles instead of the tensor-core ones"),
    switch("NANOINFER_CUDA_GEMV", Comparison, "on", "`0`: cuBLAS instead of the GEMV kernels for batches of up to 8 rows"),
    switch("NANOINFER_CUDA_GEMV_ROWS", Comparison, "1", "most rows (1-8) a projection takes through the GEMV kernels; more go to cuBLAS"),
    switch("NANOINFER_CUDA_GEMV_PREFETCH", Tuning, "the kernels' constant", "bytes of each weight row a GEMV warp prefetches into L2 before it starts"),
    switch("NANOINFER_CUDA_GRAPHS", Comparison, "on", "`0`: launch decode steps kernel by kernel instead of replaying CUDA graphs"),
    switch("NANOINFER_CUDA_OVERLAP", Comparison, "on", "`0`: each GPU decode step waits for the previous step's ids on the host"),
    switch("NANOINFER_CUDA_PDL", Comparison, "the kernels that prefetch", "`0`: no kernel launched early (programmatic dependent launch); `1`: every kernel"),
    switch("NANOINFER_CUDA_POOL_RELEASE_BYTES", Tuning, "keep everything", "bytes the `cuda-stream` pool keeps before it releases memory to the driver"),
    switch("NANOINFER_CUDA_PROFILE", Diagnostic, "off", "`N`: time every kernel with events over N repeats (graphs off) and print a table"),
    switch("NANOINFER_CUDA_W4_GEMM", Comparison, "the cost model's plan", "`0`: dequantize + cuBLAS for large int4 batches; `narrow`, `wide`, `tall`, `wide-stream-k`, `tall-stream-k`, `tall-then-narrow` or `tall-split-k`: force that int4 GEMM plan"),
    switch("NANOINFER_CUDA_W4_GEMM_ROWS", Tuning, "the measured threshold", "int4 batches up to this many rows take the int4 GEMM (sm_90); larger ones dequantize for cuBLAS"),
    switch("NANOINFER_CUDA_W4_MMA_ROWS", Tuning, "the measured threshold", "int4 batches up to this many rows run the int4 MMA kernels"),
    switch("NANOINFER_CUDA_W4_PACKED_INPUTS", Comparison, "on", "`0`: a separate packing pass before the int4 GEMM (tests/cuda.rs checks the fused packing against it)"),
    switch("NANOINFER_CUDA_W4_STREAM_K", Comparison, "on", "`0`: one block per int4 GEMM tile everywhere (no stream-K)"),
    switch("NANOINFER_KERNEL_CACHE", Setting, "`$XDG_CACHE_HOME/nanoinfer` or `~/.cache/nanoinfer`", "directory of the compiled CUDA kernels (NVRTC output)"),
];

/// The entry of `name`, if it is a registered switch.
pub fn lookup(name: &str) -> Option<&'static Switch> {
    SWITCHES.iter().find(|s| s.name == name)
}

/// The value of the registered switch `name` in the environment now (unset,
/// or not Unicode: `None`). Reading an unregistered `NANOINFER_*` name is a
/// bug: it panics in debug builds and tests, and reads nothing otherwise.
pub fn var(name: &str) -> Option<String> {
    if lookup(name).is_none() {
        debug_assert!(false, "{name} is not in the switch table (src/tuning.rs)");
        return None;
    }
    std::env::var(name).ok()
}

/// Whether the on-by-default switch `name` is on: unset or anything but `0`.
pub fn on_unless_zero(name: &str) -> bool {
    var(name).is_none_or(|v| v != "0")
}

/// The number in switch `name`, or `default` when it is unset or not a number.
pub fn number<T: std::str::FromStr>(name: &str, default: T) -> T {
    var(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `docs/tuning.md`, as generated from the table.
pub fn markdown() -> String {
    let mut out = String::from(
        "# Environment switches\n\nGenerated from `src/tuning.rs` (`NANOINFER_BLESS=1 cargo test --release --test tuning_switches`); do not edit.\nComparison switches keep a path that lost to the default; docs/rejected-ideas.md gives each one's measurement.\n\n| switch | kind | default | what it does |\n|---|---|---|---|\n",
    );
    for s in SWITCHES {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            s.name,
            s.kind.as_str(),
            s.default,
            s.doc
        ));
    }
    out
}
