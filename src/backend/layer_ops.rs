//! The device seam of the decoder: the ops a transformer layer is made of.
//! Every backend implements [`LayerOps`]; the model writes the layer
//! program once over it (`model::transformer`), so an architecture, tensor
//! parallelism or a weight format is added in one place, not per device.
//!
//! The ops are as coarse as the fast kernels are: a backend fuses what it
//! can inside one op (QKV + RoPE + KV write, gate/up + SwiGLU, a product
//! with its residual add) and may defer work to the next op (the CUDA
//! backend adds a product's output to the residual stream inside the next
//! norm, or hands the next norm's sums over from the product before it).
//! That is why [`LayerOps::norm`] names the product that reads the norm and
//! [`LayerOps::add_product`] the norm that follows it.

use crate::Result;

/// The geometry of a decoder model, as the backends see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderDims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub layers: usize,
    pub rms_norm_eps: f32,
}

impl DecoderDims {
    /// Width of a row's queries (all heads).
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of a row's keys (or values).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of a fused `[q | k | v]` row.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// 1/sqrt(head_dim), the attention score scale.
    pub fn attn_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// The types a backend keeps a decoder's weights in.
pub trait WeightFormats {
    /// A projection's weight, in any format the backend has.
    type Weight;
    /// A vector: a norm weight or a bias.
    type Vector;
    /// The embedding table (which a tied model also multiplies as its LM head).
    type Embedding;
    /// The RoPE inverse frequencies.
    type Rope;
}

/// One decoder layer's weights in a backend's formats. Llama, Qwen2 and
/// Qwen3 differ only in which options are present.
pub struct LayerWeights<F: WeightFormats> {
    pub input_norm: F::Vector,
    /// `[q | k | v]` rows: `[q_width + 2 kv_width, hidden]`.
    pub qkv: F::Weight,
    /// q, k and v biases concatenated (Qwen2).
    pub qkv_bias: Option<F::Vector>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub q_norm: Option<F::Vector>,
    pub k_norm: Option<F::Vector>,
    pub o: F::Weight,
    pub o_bias: Option<F::Vector>,
    pub post_norm: F::Vector,
    /// `[gate | up]` rows: `[2 intermediate, hidden]`.
    pub gate_up: F::Weight,
    pub down: F::Weight,
}

impl<F: WeightFormats> LayerWeights<F> {
    /// The four projections, in the order a layer runs them.
    pub fn projections(&self) -> [&F::Weight; 4] {
        [&self.qkv, &self.o, &self.gate_up, &self.down]
    }

    /// The layer's vectors (norm weights, biases), present ones only.
    pub fn vectors(&self) -> impl Iterator<Item = &F::Vector> {
        [&self.input_norm, &self.post_norm]
            .into_iter()
            .chain(self.qkv_bias.iter())
            .chain(self.q_norm.iter())
            .chain(self.k_norm.iter())
            .chain(self.o_bias.iter())
    }
}

/// A whole decoder's weights in a backend's formats.
pub struct DecoderWeights<F: WeightFormats> {
    pub embed: F::Embedding,
    pub layers: Vec<LayerWeights<F>>,
    pub final_norm: F::Vector,
    /// None when tied to the embedding table.
    pub lm_head: Option<F::Weight>,
    pub rope: F::Rope,
}

impl<F: WeightFormats> DecoderWeights<F> {
    /// The matrix the logits are computed with.
    pub fn head(&self) -> LmHead<'_, F> {
        match &self.lm_head {
            Some(w) => LmHead::Own(w),
            None => LmHead::Tied(&self.embed),
        }
    }
}

/// The LM head: a projection of its own, or the embedding table.
pub enum LmHead<'a, F: WeightFormats> {
    Own(&'a F::Weight),
    Tied(&'a F::Embedding),
}

/// The activations a residual-adding product reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// The attention output (o_proj reads it).
    Attention,
    /// The SwiGLU output (down_proj reads it).
    SwiGlu,
}

/// The ops of one forward step, bound to the step's batch, KV cache and
/// workspace. Called in this order per step: `embed`, then per layer
/// `norm`, `qkv_rope_kv_write`, `attend`, `add_product` (o), `norm`,
/// `gate_up_swiglu`, `add_product` (down), and `logits` last.
pub trait LayerOps {
    /// The weights the ops read.
    type Formats: WeightFormats;
    /// A normed input, handed from `norm` to the product that reads it
    /// (the backend decides whether it is rows, or a recipe the product
    /// applies on the fly).
    type Normed: Copy;

    /// The rows' token embeddings into the residual stream, and the rotary
    /// angles of their positions.
    fn embed(&mut self, w: &DecoderWeights<Self::Formats>) -> Result<()>;

    /// RMSNorm of the residual stream with `weight`, for `reader` (the next
    /// product). `index` counts the step's norms: 2·layer for a layer's
    /// input norm, 2·layer + 1 for its post-attention norm.
    fn norm(
        &mut self,
        index: usize,
        weight: &Vector<Self>,
        reader: &Weight<Self>,
    ) -> Result<Self::Normed>;

    /// q, k, v of the normed rows (with bias, q/k norms and RoPE as the
    /// layer has them); keys and values written into layer `layer`'s KV
    /// cache at the rows' slots.
    fn qkv_rope_kv_write(
        &mut self,
        layer: usize,
        x: Self::Normed,
        w: &LayerWeights<Self::Formats>,
    ) -> Result<()>;

    /// Attention of every row over its sequence's cached positions (its own
    /// included) in layer `layer`.
    fn attend(&mut self, layer: usize) -> Result<()>;

    /// `residual += x · wᵀ (+ bias)`. `next_norm` is the norm that reads the
    /// residual next, `(index, weight)` as `norm` numbers it (None after the
    /// last layer).
    fn add_product(
        &mut self,
        x: Activations,
        w: &Weight<Self>,
        bias: Option<&Vector<Self>>,
        next_norm: Option<(usize, &Vector<Self>)>,
    ) -> Result<()>;

    /// `act = silu(x · gateᵀ) * (x · upᵀ)`, written for `down` to read.
    fn gate_up_swiglu(
        &mut self,
        x: Self::Normed,
        gate_up: &Weight<Self>,
        down: &Weight<Self>,
    ) -> Result<()>;

    /// The final norm and the LM head, for the rows that want logits.
    fn logits(&mut self, final_norm: &Vector<Self>, head: LmHead<'_, Self::Formats>) -> Result<()>;

    /// Called between the costly parts of a layer: an error (a raised stop)
    /// ends the forward there. A device that queues the whole step at once
    /// has nothing to poll.
    fn poll_stop(&self) -> Result<()> {
        Ok(())
    }
}

/// The projection weight type of an ops implementation.
pub type Weight<O> = <<O as LayerOps>::Formats as WeightFormats>::Weight;
/// The vector type of an ops implementation.
pub type Vector<O> = <<O as LayerOps>::Formats as WeightFormats>::Vector;

/// A KV cache whose layers the CPU ops read and write as f32 slices
/// (`[slot][kv_heads * head_dim]` keys, then values).
pub trait LayerKv {
    fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]);
}
