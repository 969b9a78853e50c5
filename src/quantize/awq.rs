//! AWQ (Lin et al., 2023): activation-aware int4 quantization. Input
//! channels that see large activations matter most, so before
//! round-to-nearest each group of linears sharing an input is multiplied by
//! per-input-channel scales `s = mean|x|^α` (α grid-searched to minimize
//! the output error of the quantized linears on calibration inputs), and
//! `1/s` is folded into the op that produces the input (the RMSNorm weight,
//! or the rows of `v_proj` / `up_proj`), which leaves the f32 model's
//! function unchanged. Then each linear's weight range is clipped per group
//! (the shrink that minimizes that group's output error), except q and k
//! (their errors are amplified by the attention softmax).

use super::calib::{CalibForward, LayerWeights, Linear, Stage};
use crate::backend::cpu::exact::{self, gram, par_chunks};
use crate::backend::cpu::q4::groups_per_row;
use crate::backend::cpu::ThreadPool;
use crate::model::config::ModelConfig;
use crate::model::quant_int4::{fake_quantize, Int4, Int4Weights};
use crate::{bail_arg, Result};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AwqOptions {
    /// Points of the α grid (α = k / grid, k in 0..grid; AutoAWQ's 20).
    pub grid: usize,
    /// Search a per-group clipping range after scaling (AutoAWQ does by
    /// default; off here: on SmolLM2, whose weights already sit on a 4-bit
    /// grid, it raised perplexity, 32.6 → 33.2).
    pub clip: bool,
    /// Calibration tokens (evenly spaced) the scale search's loss uses.
    pub loss_tokens: usize,
    /// AutoAWQ's `duo_scaling`: `s = mean|x|^α / mean|ŵ|^(1−α)`, `ŵ` the
    /// weights relative to their group's max, instead of `mean|x|^α`.
    pub duo: bool,
}

impl Default for AwqOptions {
    fn default() -> Self {
        AwqOptions {
            grid: 20,
            clip: false,
            loss_tokens: 1024,
            duo: false,
        }
    }
}

/// Clipping grid: max-range shrinks `1 − k/20` for k in 0..10 (AutoAWQ's).
const CLIP_GRID: usize = 20;
const CLIP_STEPS: usize = 10;

/// Calibration activations of one input: `[n, cols]`.
pub struct Inputs<'a> {
    pub x: &'a [f32],
    pub n: usize,
    pub cols: usize,
}

impl Inputs<'_> {
    /// Every `n / k`-th row (all rows when `k >= n`).
    fn sample(&self, k: usize) -> (Vec<f32>, usize) {
        if k >= self.n {
            return (self.x.to_vec(), self.n);
        }
        let mut out = Vec::with_capacity(k * self.cols);
        for i in 0..k {
            let r = i * self.n / k;
            out.extend_from_slice(&self.x[r * self.cols..(r + 1) * self.cols]);
        }
        (out, k)
    }

    fn mean_abs(&self) -> Vec<f32> {
        let mut m = vec![0f64; self.cols];
        for row in self.x.chunks_exact(self.cols) {
            for (a, v) in m.iter_mut().zip(row) {
                *a += v.abs() as f64;
            }
        }
        m.iter().map(|&v| (v / self.n as f64) as f32).collect()
    }
}

/// Rows per parallel task of the element-wise passes.
const ROWS_PER_TASK: usize = 32;

/// `W − Q(W·diag(s))·diag(1/s)` of `w` (`[rows, cols]`): the error of
/// round-to-nearest of the scaled weights, as the unscaled layer sees it.
fn scaled_delta(
    pool: &ThreadPool,
    format: &Int4,
    w: &[f32],
    cols: usize,
    s: &[f32],
) -> Result<Vec<f32>> {
    let group = format.group_for(cols);
    let mut out = vec![0f32; w.len()];
    par_chunks(pool, &mut out, ROWS_PER_TASK * cols, &|t, chunk| {
        let mut scaled = vec![0f32; group];
        for (r, d) in chunk.chunks_exact_mut(cols).enumerate() {
            let row = &w[(t * ROWS_PER_TASK + r) * cols..][..cols];
            for c0 in (0..cols).step_by(group) {
                let c1 = (c0 + group).min(cols);
                let ws = &mut scaled[..c1 - c0];
                let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                for ((o, &v), &sc) in ws.iter_mut().zip(&row[c0..c1]).zip(&s[c0..c1]) {
                    *o = v * sc;
                    lo = lo.min(*o);
                    hi = hi.max(*o);
                }
                let (scale, zero) = format.group_params(lo, hi)?;
                for (((o, &q), &v), &sc) in d[c0..c1]
                    .iter_mut()
                    .zip(ws.iter())
                    .zip(&row[c0..c1])
                    .zip(&s[c0..c1])
                {
                    *o = v - fake_quantize(q, scale, zero) / sc;
                }
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Per input channel, the mean over all rows of `ws` of `|w|` relative to
/// the max of its group (AutoAWQ's `w_mean`).
fn weight_mean(format: &Int4, cols: usize, ws: &[(&[f32], usize)]) -> Vec<f32> {
    let group = format.group_for(cols);
    let mut sum = vec![0f64; cols];
    let mut rows = 0;
    for &(w, _) in ws {
        for row in w.chunks_exact(cols) {
            rows += 1;
            for c0 in (0..cols).step_by(group) {
                let g = &row[c0..(c0 + group).min(cols)];
                let amax = g.iter().fold(0f32, |a, v| a.max(v.abs())) + 1e-6;
                for (s, v) in sum[c0..].iter_mut().zip(g) {
                    *s += (v.abs() / amax) as f64;
                }
            }
        }
    }
    sum.iter()
        .map(|&s| (s / rows.max(1) as f64) as f32)
        .collect()
}

/// The scales (`[cols]`) for linears `ws` (each `(weights [rows, cols], rows)`)
/// reading `inputs`, with the α chosen and its loss relative to α = 0
/// (plain round-to-nearest).
pub fn search_scales(
    pool: &ThreadPool,
    format: &Int4,
    inputs: &Inputs<'_>,
    ws: &[(&[f32], usize)],
    opts: &AwqOptions,
) -> Result<(Vec<f32>, f32, f64)> {
    let cols = inputs.cols;
    if ws.iter().any(|(w, rows)| w.len() != rows * cols) || ws.is_empty() || ws.len() > 4 {
        bail_arg!("AWQ: 1 to 4 weights of {cols} inputs expected");
    }
    let (xs, n) = inputs.sample(opts.loss_tokens.max(1));
    let x_mean = inputs.mean_abs();
    let w_mean = opts.duo.then(|| weight_mean(format, cols, ws));
    let out_width: usize = ws.iter().map(|w| w.1).sum();
    let mut out = vec![0f32; n * out_width];
    let mut best: Option<(f64, f32, Vec<f32>)> = None;
    let mut rtn_loss = 0.0;
    for k in 0..opts.grid.max(1) {
        let alpha = k as f32 / opts.grid.max(1) as f32;
        let mut s: Vec<f32> = match &w_mean {
            Some(wm) => x_mean
                .iter()
                .zip(wm)
                .map(|(&m, &w)| {
                    (exact::powf(m, alpha) / (exact::powf(w, 1.0 - alpha) + 1e-4)).max(1e-4)
                })
                .collect(),
            None => x_mean
                .iter()
                .map(|&m| exact::powf(m, alpha).max(1e-4))
                .collect(),
        };
        let (lo, hi) = s
            .iter()
            .fold((f32::INFINITY, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let norm = (lo * hi).sqrt();
        s.iter_mut().for_each(|v| *v /= norm);
        // δ = W − Q(W·diag(s))·diag(1/s) for each linear; loss = ‖X δᵀ‖².
        let mut deltas = Vec::with_capacity(out_width * cols);
        for &(w, _) in ws {
            deltas.extend(scaled_delta(pool, format, w, cols, &s)?);
        }
        exact::matmul(pool, &xs, cols, &deltas, &mut out);
        let loss: f64 = out.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / out.len() as f64;
        if k == 0 {
            rtn_loss = loss;
        }
        if best.as_ref().is_none_or(|b| loss < b.0) {
            best = Some((loss, alpha, s));
        }
    }
    let (loss, alpha, s) = best.expect("the grid has a point");
    let rel = if rtn_loss > 0.0 { loss / rtn_loss } else { 1.0 };
    Ok((s, alpha, rel))
}

/// Clips each group of `w` (`[rows, cols]`, inputs `x`) to the symmetric
/// range `±max|w|·(1 − k/20)`, k in 0..10, that minimizes the group's
/// output error after quantization.
pub fn search_clip(
    pool: &ThreadPool,
    format: &Int4,
    inputs: &Inputs<'_>,
    w: &mut [f32],
    rows: usize,
) -> Result<()> {
    let cols = inputs.cols;
    if w.len() != rows * cols {
        bail_arg!("AWQ clip: weights do not have [{rows}, {cols}] values");
    }
    let group = format.group_for(cols);
    for g in 0..groups_per_row(cols, group) {
        let (c0, c1) = (g * group, ((g + 1) * group).min(cols));
        let gs = c1 - c0;
        let xg: Vec<f32> = inputs
            .x
            .chunks_exact(cols)
            .flat_map(|r| r[c0..c1].iter().copied())
            .collect();
        let hg = gram(pool, &xg, inputs.n, gs);
        let orig: Vec<f32> = w
            .chunks_exact(cols)
            .flat_map(|r| r[c0..c1].iter().copied())
            .collect();
        let amax: Vec<f32> = orig
            .chunks_exact(gs)
            .map(|r| r.iter().fold(0f32, |a, v| a.max(v.abs())))
            .collect();
        let mut best = vec![(f64::INFINITY, 0f32); rows];
        let mut delta = vec![0f32; rows * gs];
        let mut hd = vec![0f32; rows * gs];
        for k in 0..CLIP_STEPS {
            let shrink = 1.0 - k as f32 / CLIP_GRID as f32;
            par_chunks(pool, &mut delta, ROWS_PER_TASK * gs, &|t, chunk| {
                for (r, d) in chunk.chunks_exact_mut(gs).enumerate() {
                    let r = t * ROWS_PER_TASK + r;
                    let row = &orig[r * gs..(r + 1) * gs];
                    let m = amax[r] * shrink;
                    let lo = row.iter().fold(f32::INFINITY, |a, &v| a.min(v)).max(-m);
                    let hi = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)).min(m);
                    let (scale, zero) = format.group_params(lo, hi)?;
                    for (o, &v) in d.iter_mut().zip(row) {
                        *o = v - fake_quantize(v.clamp(-m, m), scale, zero);
                    }
                }
                Ok(())
            })?;
            exact::matmul(pool, &delta, gs, &hg, &mut hd);
            for (r, (d, e)) in delta.chunks_exact(gs).zip(hd.chunks_exact(gs)).enumerate() {
                let err = exact::dot(d, e);
                if err < best[r].0 {
                    best[r] = (err, amax[r] * shrink);
                }
            }
        }
        for (r, &(_, m)) in best.iter().enumerate() {
            for v in &mut w[r * cols + c0..r * cols + c1] {
                *v = v.clamp(-m, m);
            }
        }
    }
    Ok(())
}

/// What [`awq_layer`] chose, for reports.
#[derive(Debug, Clone, Default)]
pub struct AwqLayerReport {
    /// Per scaled stage: (stage, α, loss relative to round-to-nearest).
    pub scales: Vec<(Stage, f32, f64)>,
}

/// AWQ of one decoder block: runs it in f32 on `h` (replaced by its f32
/// output, as AutoAWQ feeds the next block), searches and folds the
/// scales, clips, and returns the quantized weights in [`Linear::ALL`]
/// order; `l` keeps the scaled (and clipped) f32 weights and norms.
pub fn awq_layer(
    fwd: &CalibForward<'_>,
    config: &ModelConfig,
    format: &Int4,
    opts: &AwqOptions,
    l: &mut LayerWeights,
    h: &mut [f32],
) -> Result<(Vec<Int4Weights>, AwqLayerReport)> {
    let n = fwd.tokens();
    let pool = fwd.pool();
    let mut captured: Vec<(Stage, Vec<f32>)> = Vec::with_capacity(4);
    fwd.layer(l, h, &mut |stage, x, _| {
        captured.push((stage, x.to_vec()));
        Ok(())
    })?;
    let mut report = AwqLayerReport::default();
    for (stage, x) in captured.iter_mut() {
        let stage = *stage;
        let cols = x.len() / n;
        // o's input is v's output only without GQA (and with rows to fold into).
        if stage == Stage::O && config.num_heads != config.num_kv_heads {
            continue;
        }
        let inputs = Inputs { x, n, cols };
        let ws: Vec<(&[f32], usize)> = stage
            .linears()
            .iter()
            .map(|&li| (l.weight(li), li.shape(config).0))
            .collect();
        let (s, alpha, rel) = search_scales(pool, format, &inputs, &ws, opts)?;
        report.scales.push((stage, alpha, rel));
        fold_scales(l, config, stage, &s);
        for row in x.chunks_exact_mut(cols) {
            row.iter_mut().zip(&s).for_each(|(v, s)| *v /= s);
        }
    }
    if opts.clip {
        for (stage, x) in &captured {
            let cols = x.len() / n;
            let inputs = Inputs { x, n, cols };
            for &li in stage.linears() {
                if matches!(li, Linear::Q | Linear::K) {
                    continue;
                }
                let rows = li.shape(config).0;
                search_clip(pool, format, &inputs, l.weight_mut(li), rows)?;
            }
        }
    }
    let quantized = Linear::ALL
        .iter()
        .map(|&li| {
            let (rows, cols) = li.shape(config);
            format.rtn_weights(rows, cols, l.weight(li))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((quantized, report))
}

/// Multiplies the inputs of `stage`'s linears by `s` and divides the op
/// that produces them by `s`: the f32 function is unchanged.
pub fn fold_scales(l: &mut LayerWeights, config: &ModelConfig, stage: Stage, s: &[f32]) {
    for &li in stage.linears() {
        let cols = li.shape(config).1;
        for row in l.weight_mut(li).chunks_exact_mut(cols) {
            row.iter_mut().zip(s).for_each(|(w, s)| *w *= s);
        }
    }
    let divide_rows = |w: &mut [f32], cols: usize| {
        for (row, s) in w.chunks_exact_mut(cols).zip(s) {
            row.iter_mut().for_each(|w| *w /= s);
        }
    };
    match stage {
        Stage::Qkv => l.input_norm.iter_mut().zip(s).for_each(|(w, s)| *w /= s),
        Stage::GateUp => l.post_norm.iter_mut().zip(s).for_each(|(w, s)| *w /= s),
        Stage::O => {
            divide_rows(l.weight_mut(Linear::V), config.hidden_size);
            if let Some(b) = &mut l.v_bias {
                b.iter_mut().zip(s).for_each(|(w, s)| *w /= s);
            }
        }
        Stage::Down => divide_rows(l.weight_mut(Linear::Up), config.hidden_size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::safetensors::WeightFiles;
    use crate::quantize::calib::Calibration;
    use std::path::Path;

    /// Folding any positive scales leaves the f32 block's output unchanged.
    #[test]
    fn folded_scales_keep_the_f32_function() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama3");
        let config = ModelConfig::from_dir(&dir).unwrap();
        let files = WeightFiles::open(&dir).unwrap();
        let pool = ThreadPool::new(2);
        let calib = Calibration {
            seqs: vec![(0..40).map(|i| (i * 13 + 1) % 250).collect()],
        };
        let fwd = CalibForward::new(&config, &pool, &calib);
        let h0 = fwd.embed(&files, &calib).unwrap();
        let mut l = LayerWeights::load(&files, &config, 0).unwrap();
        let mut want = h0.clone();
        fwd.layer(&mut l.clone(), &mut want, &mut |_, _, _| Ok(()))
            .unwrap();
        let mut scaled = l.clone();
        for stage in [Stage::Qkv, Stage::GateUp, Stage::Down] {
            let cols = stage.linears()[0].shape(&config).1;
            let s: Vec<f32> = (0..cols).map(|i| 0.25 + (i % 7) as f32 * 0.5).collect();
            fold_scales(&mut scaled, &config, stage, &s);
        }
        assert_ne!(scaled.input_norm, l.input_norm);
        let mut got = h0.clone();
        fwd.layer(&mut scaled, &mut got, &mut |_, _, _| Ok(()))
            .unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{i}: {a} vs {b}");
        }
        // And the search's choice at least matches round-to-nearest.
        let mut h = h0.clone();
        let (q, report) = awq_layer(
            &fwd,
            &config,
            &Int4::awq(32).unwrap(),
            &AwqOptions::default(),
            &mut l,
            &mut h,
        )
        .unwrap();
        assert_eq!(q.len(), 7);
        assert_eq!(h, want, "AWQ feeds the next block the f32 output");
        assert_eq!(report.scales.len(), 3, "o is not scaled under GQA");
        assert!(report
            .scales
            .iter()
            .all(|&(_, a, rel)| (0.0..1.0).contains(&a) && rel <= 1.0));
    }

    #[test]
    fn scale_search_helps_with_outlier_channels() {
        let (rows, cols, n) = (32, 64, 128);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let c = i % cols;
                let amp = if c % 9 == 0 { 20.0 } else { 0.5 };
                amp * (((i * 104729) % 997) as f32 / 997.0 - 0.5)
            })
            .collect();
        let pool = ThreadPool::new(2);
        let inputs = Inputs { x: &x, n, cols };
        let format = Int4::awq(32).unwrap();
        let (s, alpha, rel) = search_scales(
            &pool,
            &format,
            &inputs,
            &[(&w, rows)],
            &AwqOptions::default(),
        )
        .unwrap();
        assert!(alpha > 0.0 && rel < 0.9, "α {alpha}, loss {rel} of RTN");
        assert!(s[0] > s[1], "outlier channels get larger scales");
        // Clipping never increases the per-group error it measures.
        let mut clipped = w.clone();
        search_clip(&pool, &format, &inputs, &mut clipped, rows).unwrap();
        assert!(clipped.iter().zip(&w).all(|(c, w)| c.abs() <= w.abs()));
    }
}
