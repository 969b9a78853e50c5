//! The decoder-only transformer, written once over the device seam
//! ([`LayerOps`]): embedding → N × (RMSNorm, GQA attention with RoPE,
//! RMSNorm, SwiGLU MLP) → RMSNorm → LM head. Llama, Qwen2 and Qwen3 run
//! this same program; their differences are data in [`LayerWeights`]
//! (biases, q/k norms, head_dim, rope). A backend runs it by implementing
//! the ops; how it fuses them is its own business.

use crate::backend::layer_ops::{Activations, DecoderWeights, LayerOps, LayerWeights, Vector};
use crate::Result;

/// Runs one forward step through `ops`: every layer, then the logits of
/// the rows that want them.
pub fn forward<O: LayerOps>(ops: &mut O, w: &DecoderWeights<O::Formats>) -> Result<()> {
    ops.embed(w)?;
    for (i, layer) in w.layers.iter().enumerate() {
        let next_norm = w.layers.get(i + 1).map(|n| &n.input_norm);
        run_layer(ops, i, layer, next_norm)?;
    }
    ops.logits(&w.final_norm, w.head())
}

/// Layer `index` of the step; `next_norm` is the next layer's input norm
/// (None for the last layer).
pub fn run_layer<O: LayerOps>(
    ops: &mut O,
    index: usize,
    l: &LayerWeights<O::Formats>,
    next_norm: Option<&Vector<O>>,
) -> Result<()> {
    // Polled three times a layer (attention, then the two halves of the
    // MLP, are its costly parts) so a stop takes effect well within one
    // layer's time.
    ops.poll_stop()?;
    let x = ops.norm(2 * index, &l.input_norm, &l.qkv)?;
    ops.qkv_rope_kv_write(index, x, l)?;
    ops.attend(index)?;
    ops.poll_stop()?;
    let post = Some((2 * index + 1, &l.post_norm));
    ops.add_product(Activations::Attention, &l.o, l.o_bias.as_ref(), post)?;
    let x = ops.norm(2 * index + 1, &l.post_norm, &l.gate_up)?;
    ops.gate_up_swiglu(x, &l.gate_up, &l.down)?;
    ops.poll_stop()?;
    let next = next_norm.map(|n| (2 * index + 2, n));
    ops.add_product(Activations::SwiGlu, &l.down, None, next)
}
