//! Kernels over the packed layout of [`PackedBf16`]: `out[r, c] = Σ_j
//! x[r, j] · w[c, j]` with f32 activations and accumulation. Without
//! BF16 instructions the lines are widened to f32 by the tiles of
//! `packed_kernels.rs` (shared with F32 and F16).

use super::bf16::PackedBf16;
use super::isa::Isa;
use super::packed_kernels::packed_blocks;

/// `out[r, b·16 + j] = Σ_k x[r, k] · w[b·16 + j, k]` for rows `r < m` and the
/// weight rows of blocks `b0..b1`.
///
/// # Safety
/// `isa` must be supported by the CPU; `x` holds at least `m · w.cols`
/// values; `out` points at an `[m, stride]` buffer whose columns
/// `b0·16 .. min(b1·16, w.rows)` belong to this call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn bf16_blocks(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedBf16,
    b0: usize,
    b1: usize,
    out: *mut f32,
    stride: usize,
) {
    packed_blocks(isa, x, m, w, b0, b1, out, stride)
}
