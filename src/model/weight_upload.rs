//! A decoder's weights onto a backend: the checkpoint's tensor names and
//! shapes (the HF layout Llama, Qwen2 and Qwen3 share) written once; each
//! backend says how a projection, a vector and the embedding table become
//! its own formats ([`WeightUpload`]).

use super::config::ModelConfig;
use super::quant::QuantMethod;
use super::weights::WeightSource;
use crate::backend::{DecoderWeights, LayerWeights, WeightFormats};
use crate::Result;

/// A projection as stored: parts `(tensor name, rows)` stacked by rows,
/// each over `cols` inputs (q, k, v make one projection; so do gate, up).
pub struct Projection {
    pub parts: Vec<(String, usize)>,
    pub cols: usize,
}

/// Where an LM head that is not the embedding table itself comes from.
pub struct HeadSource<'a> {
    /// `lm_head.weight`, or the embedding table for the quantized copy of a
    /// tied head.
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    /// The checkpoint's int4 format, when the head may be stored in it.
    pub stored: Option<&'a dyn QuantMethod>,
    /// The method that quantizes it at load, if any.
    pub method: Option<&'a dyn QuantMethod>,
}

type Weight<U> = <<U as WeightUpload>::Formats as WeightFormats>::Weight;
type Vector<U> = <<U as WeightUpload>::Formats as WeightFormats>::Vector;

/// How one backend turns checkpoint tensors into its weights.
pub trait WeightUpload {
    type Formats: WeightFormats;
    /// The projections of `jobs`, in order (a backend may prepare them in
    /// parallel).
    fn projections(&mut self, jobs: &[Projection]) -> Result<Vec<Weight<Self>>>;
    /// 1-D tensors `(name, len)`, concatenated.
    fn vector(&mut self, parts: &[(&str, usize)]) -> Result<Vector<Self>>;
    fn lm_head(&mut self, head: &HeadSource<'_>) -> Result<Weight<Self>>;
    /// The embedding table `[rows, cols]`; `is_head` when it doubles as
    /// the LM head.
    fn embedding(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        is_head: bool,
    ) -> Result<<Self::Formats as WeightFormats>::Embedding>;
    fn rope(&mut self, inv_freq: &[f32]) -> Result<<Self::Formats as WeightFormats>::Rope>;
}

/// Layers whose projections are prepared at once (bounds the host memory
/// of converted or repacked weights).
const LOAD_LAYERS_AT_ONCE: usize = 4;

/// Loads every weight of the decoder `c` describes from `src` through
/// `up`. `stored` is the int4 format config.json names (projections load
/// as stored); `method` quantizes the others at load (and the LM head when
/// the method says so).
pub fn load_decoder<U: WeightUpload>(
    c: &ModelConfig,
    src: &dyn WeightSource,
    stored: Option<&dyn QuantMethod>,
    method: Option<&dyn QuantMethod>,
    up: &mut U,
) -> Result<DecoderWeights<U::Formats>> {
    let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
    let mut layers = Vec::with_capacity(c.num_layers);
    for first in (0..c.num_layers).step_by(LOAD_LAYERS_AT_ONCE) {
        let span = first..(first + LOAD_LAYERS_AT_ONCE).min(c.num_layers);
        let jobs: Vec<Projection> = span
            .clone()
            .flat_map(|i| {
                let n = |s: &str| format!("model.layers.{i}.{s}");
                let job = |parts: Vec<(String, usize)>, cols| Projection { parts, cols };
                [
                    job(
                        vec![
                            (n("self_attn.q_proj.weight"), nq),
                            (n("self_attn.k_proj.weight"), nkv),
                            (n("self_attn.v_proj.weight"), nkv),
                        ],
                        d,
                    ),
                    job(vec![(n("self_attn.o_proj.weight"), d)], nq),
                    job(
                        vec![
                            (n("mlp.gate_proj.weight"), inter),
                            (n("mlp.up_proj.weight"), inter),
                        ],
                        d,
                    ),
                    job(vec![(n("mlp.down_proj.weight"), d)], inter),
                ]
            })
            .collect();
        let mut products = up.projections(&jobs)?.into_iter();
        for i in span {
            let mut next = || products.next().expect("four projections per layer");
            let (qkv, o, gate_up, down) = (next(), next(), next(), next());
            let n = |s: &str| format!("model.layers.{i}.{s}");
            let mut optional = |name: &str, len: usize, on: bool| {
                on.then(|| up.vector(&[(&n(name), len)])).transpose()
            };
            let o_bias = optional("self_attn.o_proj.bias", d, c.o_bias)?;
            let q_norm = optional("self_attn.q_norm.weight", hd, c.qk_norm)?;
            let k_norm = optional("self_attn.k_norm.weight", hd, c.qk_norm)?;
            let qkv_bias = if c.qkv_bias {
                Some(up.vector(&[
                    (&n("self_attn.q_proj.bias"), nq),
                    (&n("self_attn.k_proj.bias"), nkv),
                    (&n("self_attn.v_proj.bias"), nkv),
                ])?)
            } else {
                None
            };
            layers.push(LayerWeights {
                input_norm: up.vector(&[(&n("input_layernorm.weight"), d)])?,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o,
                o_bias,
                post_norm: up.vector(&[(&n("post_attention_layernorm.weight"), d)])?,
                gate_up,
                down,
            });
        }
    }
    let lm_head = match head_source(c, src, stored, method) {
        Some(head) => Some(up.lm_head(&head)?),
        None => None,
    };
    let embed = up.embedding(EMBED, c.vocab_size, d, lm_head.is_none())?;
    Ok(DecoderWeights {
        embed,
        layers,
        final_norm: up.vector(&[("model.norm.weight", d)])?,
        lm_head,
        rope: up.rope(&c.rope_inv_freq())?,
    })
}

const EMBED: &str = "model.embed_tokens.weight";

/// Where the LM head comes from, or None when it is the embedding table:
/// a model with a head of its own (untied, or a tied checkpoint that
/// stores a quantized copy: GPTQ's `lm_head: true`, our q8_0 writer), or a
/// quantized copy of the table when `method` quantizes heads.
fn head_source<'a>(
    c: &ModelConfig,
    src: &dyn WeightSource,
    stored: Option<&'a dyn QuantMethod>,
    method: Option<&'a dyn QuantMethod>,
) -> Option<HeadSource<'a>> {
    const HEAD: &str = "lm_head.weight";
    let method = method.filter(|m| m.quantizes_lm_head());
    let own = !c.tie_word_embeddings
        || src.contains(HEAD)
        || stored.is_some_and(|m| m.quantizes_lm_head() && src.stores_quantized(m, HEAD));
    let (name, stored) = if own {
        (HEAD, stored)
    } else if method.is_some() {
        // Tied: the head gets its own quantized copy, lookups stay dense.
        (EMBED, None)
    } else {
        return None;
    };
    Some(HeadSource {
        name,
        rows: c.vocab_size,
        cols: c.hidden_size,
        stored,
        method,
    })
}
