//! A session's step temporaries on the GPU, sized once for the context's
//! largest step.

use super::ARGMAX_SPLITS;
use crate::backend::cuda::DeviceBuffer;

/// Per-session temporaries, sized once for the context's largest step.
pub(super) struct Workspace {
    pub(super) hidden: DeviceBuffer<u16>,
    pub(super) normed: DeviceBuffer<u16>,
    pub(super) qkv: DeviceBuffer<u16>,
    pub(super) attn: DeviceBuffer<u16>,
    /// Output of o_proj / down_proj: the residual's next delta.
    pub(super) delta: DeviceBuffer<u16>,
    pub(super) gate_up: DeviceBuffer<u16>,
    pub(super) act: DeviceBuffer<u16>,
    pub(super) head_in: DeviceBuffer<u16>,
    pub(super) logits: DeviceBuffer<f32>,
    pub(super) part_o: DeviceBuffer<f32>,
    pub(super) part_ml: DeviceBuffer<f32>,
    /// (cos, sin) per row and rotary frequency of this step (rope_table).
    pub(super) rope_cs: DeviceBuffer<f32>,
    /// Two sets of HANDOFF_ROWS sums of squares for int4 norm handoffs,
    /// used in turn (see `CudaForward::norm_handoff`): 64-bit fixed point,
    /// two f32s each.
    pub(super) norm_sums: DeviceBuffer<f32>,
    /// Step inputs (tokens, slots, positions, tables), uploaded once per step.
    pub(super) inputs: DeviceBuffer<u32>,
    /// Greedy token ids of the logits rows.
    pub(super) argmax: DeviceBuffer<u32>,
    /// Per-slice (logit, index) keys of argmax_partial.
    pub(super) argmax_part: DeviceBuffer<u64>,
    /// Int4 batches above `w4_mma_rows`: the int4 GEMM's packed
    /// activations, or (GPUs without it) the weights dequantized for cuBLAS.
    pub(super) w4_scratch: Option<DeviceBuffer<u16>>,
    /// Activations gathered for act-order int4 weights.
    pub(super) w4_x: Option<DeviceBuffer<u16>>,
}

/// Sizes of the workspace buffers in elements, in field order.
pub(super) struct WorkspaceSizes {
    pub(super) act16: [usize; 8],
    pub(super) f32s: [usize; 5],
    pub(super) inputs: usize,
    pub(super) w4_scratch: usize,
    pub(super) w4_x: usize,
}

impl WorkspaceSizes {
    /// Bytes of each buffer `new_workspace` allocates, in its order (keep
    /// the two in step: a `CudaBuddy` is sized by replaying this list).
    pub(super) fn buffer_bytes(&self, logits_rows: usize) -> Vec<usize> {
        let l = logits_rows.max(1);
        let mut v: Vec<usize> = self.act16.iter().map(|&n| n.max(1) * 2).collect();
        v.extend(self.f32s.iter().map(|&n| n.max(1) * 4));
        v.push(self.inputs.max(1) * 4);
        v.push(l * 4);
        v.push(l * ARGMAX_SPLITS * 8);
        v.extend(
            [self.w4_scratch, self.w4_x]
                .into_iter()
                .filter(|&n| n > 0)
                .map(|n| n * 2),
        );
        v
    }
}
