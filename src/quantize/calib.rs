//! Calibration for the int4 quantizers (AWQ scaling, GPTQ): token sequences
//! from a calibration text, and an f32 forward of one decoder layer at a
//! time that hands each group of linear layers its input (the activations
//! the quantizer must preserve) before applying them, so the quantizer may
//! replace their weights first.

use crate::backend::cpu::exact::{
    self, attention, rms_norm, rms_norm_in_place, silu_mul, Heads, Span,
};
use crate::backend::cpu::ops::{add_in_place, apply_rope};
use crate::backend::cpu::ThreadPool;
use crate::backend::layer_ops::{
    Activations, DecoderWeights, LayerOps, LayerWeights as ProgramLayer, LmHead, WeightFormats,
};
use crate::model::config::ModelConfig;
use crate::model::safetensors::WeightFiles;
use crate::model::transformer;
use crate::tokenizer::Tokenizer;
use crate::{bail_arg, untrusted_file, Error, ErrorKind, Result};
use std::path::Path;

/// Calibration tokens used unless told otherwise (`--calib-tokens`).
pub const DEFAULT_CALIB_TOKENS: usize = 2048;
/// Tokens per calibration sequence (AutoAWQ's and GPTQ's usual length).
pub const CALIB_SEQ_LEN: usize = 512;

/// Calibration token sequences (each at most [`CALIB_SEQ_LEN`] long).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calibration {
    pub seqs: Vec<Vec<u32>>,
}

impl Calibration {
    /// The first `max_tokens` tokens of `text`, cut into sequences.
    pub fn from_text(tokenizer: &Tokenizer, text: &str, max_tokens: usize) -> Result<Calibration> {
        if max_tokens < 2 {
            bail_arg!("calibration needs at least 2 tokens, asked for {max_tokens}");
        }
        let mut tokens = tokenizer.encode(text, false)?;
        if tokens.len() < 2 {
            bail_arg!(
                "the calibration text has {} token(s); it needs at least 2",
                tokens.len()
            );
        }
        tokens.truncate(max_tokens);
        Ok(Calibration {
            seqs: tokens.chunks(CALIB_SEQ_LEN).map(<[u32]>::to_vec).collect(),
        })
    }

    /// [`Calibration::from_text`] of a UTF-8 text file, tokenized with the
    /// tokenizer of `model_dir`.
    pub fn from_file(model_dir: &Path, path: &Path, max_tokens: usize) -> Result<Calibration> {
        let text = untrusted_file::read_text(path, untrusted_file::MAX_INPUT_TEXT_BYTES)
            .map_err(|e| Error::invalid_arg(format!("calibration file: {}", e.message)))?;
        if text.trim().is_empty() {
            bail_arg!("calibration file {} is empty", path.display());
        }
        let tokenizer = Tokenizer::from_dir(model_dir)?;
        Self::from_text(&tokenizer, &text, max_tokens)
            .map_err(|e| Error::invalid_arg(format!("{}: {}", path.display(), e.message)))
    }

    /// Tokens in all sequences.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(Vec::len).sum()
    }
}

/// A linear layer of a decoder block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linear {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Linear {
    pub const ALL: [Linear; 7] = [
        Linear::Q,
        Linear::K,
        Linear::V,
        Linear::O,
        Linear::Gate,
        Linear::Up,
        Linear::Down,
    ];

    fn path(self) -> &'static str {
        match self {
            Linear::Q => "self_attn.q_proj",
            Linear::K => "self_attn.k_proj",
            Linear::V => "self_attn.v_proj",
            Linear::O => "self_attn.o_proj",
            Linear::Gate => "mlp.gate_proj",
            Linear::Up => "mlp.up_proj",
            Linear::Down => "mlp.down_proj",
        }
    }

    /// The checkpoint name of this layer's weight in block `layer`.
    pub fn weight_name(self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.weight", self.path())
    }

    /// `[out, in]` of the weight.
    pub fn shape(self, c: &ModelConfig) -> (usize, usize) {
        let (d, inter) = (c.hidden_size, c.intermediate_size);
        let (nq, nkv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        match self {
            Linear::Q => (nq, d),
            Linear::K | Linear::V => (nkv, d),
            Linear::O => (d, nq),
            Linear::Gate | Linear::Up => (inter, d),
            Linear::Down => (d, inter),
        }
    }
}

/// Linear layers that read the same input, in the order of the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// q, k, v after the input norm.
    Qkv,
    /// o after attention.
    O,
    /// gate, up after the post-attention norm.
    GateUp,
    /// down after the SwiGLU product.
    Down,
}

impl Stage {
    pub const ALL: [Stage; 4] = [Stage::Qkv, Stage::O, Stage::GateUp, Stage::Down];

    pub fn linears(self) -> &'static [Linear] {
        match self {
            Stage::Qkv => &[Linear::Q, Linear::K, Linear::V],
            Stage::O => &[Linear::O],
            Stage::GateUp => &[Linear::Gate, Linear::Up],
            Stage::Down => &[Linear::Down],
        }
    }
}

/// One decoder block's weights in f32 (`[out, in]` row-major matrices).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub index: usize,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// Indexed like [`Linear::ALL`].
    pub linears: [Vec<f32>; 7],
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

impl LayerWeights {
    pub fn load(files: &WeightFiles, c: &ModelConfig, index: usize) -> Result<LayerWeights> {
        let p = format!("model.layers.{index}");
        let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
            Ok(files
                .require(&format!("{p}.{name}"), &[len])?
                .to_f32()?
                .into_owned())
        };
        let opt = |name: &str, len: usize, on: bool| on.then(|| vector(name, len)).transpose();
        let (hd, d) = (c.head_dim, c.hidden_size);
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let mut linears: [Vec<f32>; 7] = Default::default();
        for (slot, l) in linears.iter_mut().zip(Linear::ALL) {
            let (rows, cols) = l.shape(c);
            *slot = files
                .require(&l.weight_name(index), &[rows, cols])?
                .to_f32()?
                .into_owned();
        }
        Ok(LayerWeights {
            index,
            input_norm: vector("input_layernorm.weight", d)?,
            post_norm: vector("post_attention_layernorm.weight", d)?,
            linears,
            q_bias: opt("self_attn.q_proj.bias", nq, c.qkv_bias)?,
            k_bias: opt("self_attn.k_proj.bias", nkv, c.qkv_bias)?,
            v_bias: opt("self_attn.v_proj.bias", nkv, c.qkv_bias)?,
            o_bias: opt("self_attn.o_proj.bias", d, c.o_bias)?,
            q_norm: opt("self_attn.q_norm.weight", hd, c.qk_norm)?,
            k_norm: opt("self_attn.k_norm.weight", hd, c.qk_norm)?,
        })
    }

    pub fn weight(&self, l: Linear) -> &[f32] {
        &self.linears[l as usize]
    }

    pub fn weight_mut(&mut self, l: Linear) -> &mut Vec<f32> {
        &mut self.linears[l as usize]
    }
}

/// What [`CalibForward::layer`] calls before each stage: `(stage, its
/// input [tokens, in], the block's weights)`.
pub type StageHook<'h> = dyn FnMut(Stage, &[f32], &mut LayerWeights) -> Result<()> + 'h;

/// The f32 forward of decoder blocks over all calibration sequences at once
/// (`[tokens, hidden]` activations, each sequence causal on its own).
pub struct CalibForward<'a> {
    config: &'a ModelConfig,
    pool: &'a ThreadPool,
    /// (first row, length) of each sequence.
    spans: Vec<(usize, usize)>,
    /// `[tokens, head_dim/2]` RoPE tables of every row's position.
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Calibration tokens in all sequences.
    tokens: usize,
}

impl<'a> CalibForward<'a> {
    pub fn new(config: &'a ModelConfig, pool: &'a ThreadPool, calib: &Calibration) -> Self {
        let inv_freq = config.rope_inv_freq();
        let half = inv_freq.len();
        let n = calib.tokens();
        let (mut cos, mut sin) = (vec![0f32; n * half], vec![0f32; n * half]);
        let mut spans = Vec::with_capacity(calib.seqs.len());
        let mut row = 0;
        for s in &calib.seqs {
            spans.push((row, s.len()));
            for pos in 0..s.len() {
                for (j, &f) in inv_freq.iter().enumerate() {
                    // The decoder's f32 angle; its sine and cosine from the
                    // reproducible kernels (the C library's vary by CPU).
                    let (s, c) = exact::sin_cos(f64::from(f * pos as f32));
                    cos[(row + pos) * half + j] = c as f32;
                    sin[(row + pos) * half + j] = s as f32;
                }
            }
            row += s.len();
        }
        CalibForward {
            config,
            pool,
            spans,
            cos,
            sin,
            tokens: n,
        }
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn pool(&self) -> &ThreadPool {
        self.pool
    }

    /// The embeddings of the calibration tokens, `[tokens, hidden]`.
    pub fn embed(&self, files: &WeightFiles, calib: &Calibration) -> Result<Vec<f32>> {
        let c = self.config;
        let d = c.hidden_size;
        let table = files
            .require("model.embed_tokens.weight", &[c.vocab_size, d])?
            .to_f32()?;
        let mut h = Vec::with_capacity(self.tokens() * d);
        for &t in calib.seqs.iter().flatten() {
            let t = t as usize;
            if t >= c.vocab_size {
                bail_arg!(
                    "calibration token {t} is outside the vocabulary ({})",
                    c.vocab_size
                );
            }
            h.extend_from_slice(&table[t * d..(t + 1) * d]);
        }
        Ok(h)
    }

    /// `out = x · [w of each linear]ᵀ`, side by side.
    fn project(&self, l: &LayerWeights, linears: &[Linear], x: &[f32], out: &mut [f32]) {
        let cols = linears[0].shape(self.config).1;
        let w: Vec<f32> = linears
            .iter()
            .flat_map(|&li| l.weight(li).iter().copied())
            .collect();
        exact::matmul(self.pool, x, cols, &w, out);
    }

    /// Runs block `l` on `h` (`[tokens, hidden]`, replaced by the block's
    /// output): the model's layer program over [`CalibOps`]. Before each
    /// stage's linears are applied, `hook(stage, x, l)` gets their input `x`
    /// (`[tokens, in]`) and may change `l`'s weights.
    pub fn layer(
        &self,
        l: &mut LayerWeights,
        h: &mut [f32],
        hook: &mut StageHook<'_>,
    ) -> Result<()> {
        let c = self.config;
        if h.len() != self.tokens() * c.hidden_size {
            bail_arg!(
                "hidden states hold {} values, expected {}",
                h.len(),
                self.tokens() * c.hidden_size
            );
        }
        let program_view = program_view(c);
        let index = l.index;
        let mut ops = CalibOps {
            fwd: self,
            l,
            h,
            hook,
            normed: Vec::new(),
            qkv: Vec::new(),
            keys: Vec::new(),
            values: Vec::new(),
            attn: Vec::new(),
            act: Vec::new(),
        };
        transformer::run_layer(&mut ops, index, &program_view, None)
    }
}

/// The weights as the layer program sees them in calibration: tags naming
/// what [`CalibOps`] reads from the block's [`LayerWeights`], which the
/// hooks may change between the products.
struct CalibFormats;

/// A vector of the block.
#[derive(Debug, Clone, Copy)]
enum Vector {
    InputNorm,
    PostNorm,
    /// q, k and v biases (added per part).
    QkvBias,
    QNorm,
    KNorm,
    OBias,
}

impl WeightFormats for CalibFormats {
    type Weight = Stage;
    type Vector = Vector;
    type Embedding = ();
    type Rope = ();
}

/// The program's view of a block of model `c`: which vectors it has.
fn program_view(c: &ModelConfig) -> ProgramLayer<CalibFormats> {
    ProgramLayer {
        input_norm: Vector::InputNorm,
        qkv: Stage::Qkv,
        qkv_bias: c.qkv_bias.then_some(Vector::QkvBias),
        q_norm: c.qk_norm.then_some(Vector::QNorm),
        k_norm: c.qk_norm.then_some(Vector::KNorm),
        o: Stage::O,
        o_bias: c.o_bias.then_some(Vector::OBias),
        post_norm: Vector::PostNorm,
        gate_up: Stage::GateUp,
        down: Stage::Down,
    }
}

/// One block's forward over all calibration tokens on the reproducible
/// kernels (`exact`), calling the hook before each stage's products.
struct CalibOps<'f, 'a, 'h> {
    fwd: &'f CalibForward<'a>,
    l: &'f mut LayerWeights,
    /// The residual stream, `[tokens, hidden]`.
    h: &'f mut [f32],
    hook: &'f mut StageHook<'h>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    /// Row `i`'s key and value (every token is its own position).
    keys: Vec<f32>,
    values: Vec<f32>,
    attn: Vec<f32>,
    act: Vec<f32>,
}

impl CalibOps<'_, '_, '_> {
    fn vector(&self, v: Vector) -> Option<&Vec<f32>> {
        let l = &*self.l;
        match v {
            Vector::InputNorm => Some(&l.input_norm),
            Vector::PostNorm => Some(&l.post_norm),
            Vector::QNorm => l.q_norm.as_ref(),
            Vector::KNorm => l.k_norm.as_ref(),
            Vector::OBias => l.o_bias.as_ref(),
            Vector::QkvBias => None,
        }
    }

    /// The hook for `stage`'s input `x`, then `out = x · [w of its linears]ᵀ`.
    fn hooked_product(&mut self, stage: Stage, x: &[f32], out: &mut [f32]) -> Result<()> {
        (self.hook)(stage, x, self.l)?;
        self.fwd.project(self.l, stage.linears(), x, out);
        Ok(())
    }

    /// `h += x · [w of stage's linears]ᵀ (+ o's bias)`, after the hook.
    fn add_into_residual(&mut self, stage: Stage, x: &[f32]) -> Result<()> {
        let d = self.fwd.config.hidden_size;
        let mut proj = vec![0f32; self.h.len()];
        self.hooked_product(stage, x, &mut proj)?;
        if let (Stage::O, Some(b)) = (stage, &self.l.o_bias) {
            proj.chunks_exact_mut(d).for_each(|r| add_in_place(r, b));
        }
        add_in_place(self.h, &proj);
        Ok(())
    }
}

impl LayerOps for CalibOps<'_, '_, '_> {
    type Formats = CalibFormats;
    /// The normed rows are in `normed`.
    type Normed = ();

    fn embed(&mut self, _w: &DecoderWeights<CalibFormats>) -> Result<()> {
        Err(Error::new(
            ErrorKind::Internal,
            "the calibration forward runs block by block (CalibForward::embed)",
        ))
    }

    fn norm(&mut self, _index: usize, weight: &Vector, _reader: &Stage) -> Result<()> {
        let eps = self.fwd.config.rms_norm_eps;
        let mut normed = std::mem::take(&mut self.normed);
        normed.resize(self.h.len(), 0.0);
        let w = self
            .vector(*weight)
            .expect("norm weights are always present");
        rms_norm(self.h, w, eps, &mut normed);
        self.normed = normed;
        Ok(())
    }

    fn qkv_rope_kv_write(
        &mut self,
        _layer: usize,
        _x: (),
        _w: &ProgramLayer<CalibFormats>,
    ) -> Result<()> {
        let c = self.fwd.config;
        let n = self.fwd.tokens();
        let hd = c.head_dim;
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let width = nq + 2 * nkv;
        let normed = std::mem::take(&mut self.normed);
        let mut qkv = vec![0f32; n * width];
        self.hooked_product(Stage::Qkv, &normed, &mut qkv)?;
        self.normed = normed;
        let l = &*self.l;
        let half = hd / 2;
        let (mut keys, mut values) = (vec![0f32; n * nkv], vec![0f32; n * nkv]);
        for row in 0..n {
            let r = &mut qkv[row * width..(row + 1) * width];
            let (q, rest) = r.split_at_mut(nq);
            let (k, v) = rest.split_at_mut(nkv);
            for (x, b) in [
                (&mut *q, &l.q_bias),
                (&mut *k, &l.k_bias),
                (&mut *v, &l.v_bias),
            ] {
                if let Some(b) = b {
                    add_in_place(x, b);
                }
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm_in_place(q, qn, c.rms_norm_eps);
                rms_norm_in_place(k, kn, c.rms_norm_eps);
            }
            let (cos, sin) = (
                &self.fwd.cos[row * half..(row + 1) * half],
                &self.fwd.sin[row * half..(row + 1) * half],
            );
            apply_rope(q, hd, cos, sin);
            apply_rope(k, hd, cos, sin);
            keys[row * nkv..(row + 1) * nkv].copy_from_slice(k);
            values[row * nkv..(row + 1) * nkv].copy_from_slice(v);
        }
        (self.qkv, self.keys, self.values) = (qkv, keys, values);
        Ok(())
    }

    fn attend(&mut self, _layer: usize) -> Result<()> {
        let c = self.fwd.config;
        let dims = c.dims();
        let spans: Vec<Span> = self
            .fwd
            .spans
            .iter()
            .map(|&(start, len)| Span { start, len })
            .collect();
        let heads = Heads {
            n_heads: dims.heads,
            n_kv_heads: dims.kv_heads,
            head_dim: dims.head_dim,
            scale: dims.attn_scale(),
        };
        let mut attn = vec![0f32; self.fwd.tokens() * dims.q_width()];
        attention(
            self.fwd.pool,
            &heads,
            &spans,
            &self.qkv,
            dims.qkv_width(),
            &self.keys,
            &self.values,
            &mut attn,
        );
        // Freed before the MLP, whose activations are the larger.
        (self.qkv, self.keys, self.values) = Default::default();
        self.attn = attn;
        Ok(())
    }

    fn add_product(
        &mut self,
        x: Activations,
        w: &Stage,
        _bias: Option<&Vector>,
        _next_norm: Option<(usize, &Vector)>,
    ) -> Result<()> {
        let input = match x {
            Activations::Attention => std::mem::take(&mut self.attn),
            Activations::SwiGlu => std::mem::take(&mut self.act),
        };
        self.add_into_residual(*w, &input)
    }

    fn gate_up_swiglu(&mut self, _x: (), _gate_up: &Stage, _down: &Stage) -> Result<()> {
        let inter = self.fwd.config.intermediate_size;
        let n = self.fwd.tokens();
        let normed = std::mem::take(&mut self.normed);
        let mut gate_up = vec![0f32; n * 2 * inter];
        self.hooked_product(Stage::GateUp, &normed, &mut gate_up)?;
        self.normed = normed;
        let mut act = vec![0f32; n * inter];
        for (gu, a) in gate_up
            .chunks_exact(2 * inter)
            .zip(act.chunks_exact_mut(inter))
        {
            let (g, u) = gu.split_at(inter);
            silu_mul(g, u, a);
        }
        self.act = act;
        Ok(())
    }

    fn logits(&mut self, _final_norm: &Vector, _head: LmHead<'_, CalibFormats>) -> Result<()> {
        Err(Error::new(
            ErrorKind::Internal,
            "the calibration forward computes no logits",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::eval::greedy_with_logits;
    use crate::engine::{Model, ModelParams};

    fn repo(rel: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }

    /// The calibration forward (then the final norm and the LM head) gives
    /// the engine's logits, for each fixture architecture.
    #[test]
    fn calibration_forward_matches_the_engine() {
        let pool = ThreadPool::new(2);
        for fixture in ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"] {
            let dir = repo(&format!("tests/data/{fixture}"));
            let config = ModelConfig::from_dir(&dir).unwrap();
            let files = WeightFiles::open(&dir).unwrap();
            let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 200).collect();
            let calib = Calibration {
                seqs: vec![prompt[..9].to_vec(), prompt.clone()],
            };
            let fwd = CalibForward::new(&config, &pool, &calib);
            let mut h = fwd.embed(&files, &calib).unwrap();
            let mut stages = Vec::new();
            for i in 0..config.num_layers {
                let mut l = LayerWeights::load(&files, &config, i).unwrap();
                fwd.layer(&mut l, &mut h, &mut |s, x, _| {
                    stages.push((s, x.len()));
                    Ok(())
                })
                .unwrap();
            }
            assert_eq!(stages.len(), 4 * config.num_layers);
            assert_eq!(stages[3], (Stage::Down, 33 * config.intermediate_size));
            // Logits of the last row of the second sequence.
            let d = config.hidden_size;
            let last = &h[(33 - 1) * d..33 * d];
            let norm = files.get("model.norm.weight").unwrap().to_f32().unwrap();
            let mut normed = vec![0f32; d];
            rms_norm(last, &norm, config.rms_norm_eps, &mut normed);
            let head_name = if files.contains("lm_head.weight") {
                "lm_head.weight"
            } else {
                "model.embed_tokens.weight"
            };
            let head = files.get(head_name).unwrap().to_f32().unwrap();
            let ours: Vec<f32> = head
                .chunks_exact(d)
                .map(|r| r.iter().zip(&normed).map(|(a, b)| a * b).sum())
                .collect();

            let params = ModelParams {
                threads: 1,
                ..Default::default()
            };
            let model = Model::load(&dir, &params, None).unwrap();
            let (_, logits) = greedy_with_logits(&model, &prompt, 1).unwrap();
            let want = &logits[0];
            assert_eq!(want.len(), ours.len());
            for (i, (a, b)) in ours.iter().zip(want.iter()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-3 * b.abs().max(1.0),
                    "{fixture} logit {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn calibration_text_errors() {
        let dir = repo("tests/data/tokenizer/bytelevel");
        let missing = Calibration::from_file(&dir, &repo("tests/data/no-such-calib.txt"), 64)
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("calibration file") && missing.contains("no-such-calib.txt"),
            "{missing}"
        );
        let empty =
            std::env::temp_dir().join(format!("nanoinfer-empty-calib-{}", std::process::id()));
        std::fs::write(&empty, " \n").unwrap();
        let e = Calibration::from_file(&dir, &empty, 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is empty"), "{e}");
        std::fs::remove_file(&empty).unwrap();
        let calib = Calibration::from_file(&dir, &repo("tests/data/calib.txt"), 1000).unwrap();
        assert_eq!(calib.tokens(), 1000);
        assert_eq!(calib.seqs.len(), 2);
        assert_eq!(calib.seqs[0].len(), CALIB_SEQ_LEN);
    }
}
