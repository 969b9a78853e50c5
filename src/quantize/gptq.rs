//! GPTQ (Frantar et al., 2022): int4 quantization of a linear layer that
//! minimizes `‖W X − Ŵ X‖` over calibration inputs `X`, one input column at
//! a time, spreading each column's rounding error over the columns not yet
//! quantized through the inverse Hessian `H⁻¹`, `H = 2 X Xᵀ`.
//!
//! As in the paper's reference: dead inputs (zero Hessian diagonal) are
//! zeroed, `H` is damped by a fraction of its mean diagonal, `Hinv` is the
//! upper Cholesky factor of `H⁻¹`, and each group's scale and zero are
//! computed from the (error-updated) weights when quantization reaches the
//! group's first column. Act-order (`desc_act`) visits inputs by decreasing
//! `H` diagonal and records each input's group in `g_idx`. Rows are
//! independent given `Hinv`, so they are processed in parallel tiles (the
//! reference's lazy block updates give the same result; they exist to
//! batch GPU work).

use super::calib::{CalibForward, LayerWeights, Stage};
use super::linalg::{gram, inverse_upper_cholesky};
use crate::backend::cpu::exact::{axpy, multiversion};
use crate::backend::cpu::q4::groups_per_row;
use crate::backend::cpu::ThreadPool;
use crate::model::quant_int4::{fake_quantize, quantize_value, Int4, Int4Weights};
use crate::{bail_arg, Result};
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqOptions {
    /// Damping added to `H`'s diagonal, as a fraction of its mean (GPTQ's `damp_percent`).
    pub damp: f32,
    /// Quantize inputs by decreasing Hessian diagonal (`desc_act`, written with `g_idx`).
    pub act_order: bool,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            damp: 0.01,
            act_order: false,
        }
    }
}

/// Rows quantized together (they share each `Hinv` row while it is in cache).
const TILE: usize = 8;

/// GPTQ of `w` (`[rows, cols]`) given `h = Xᵀ X` (`[cols, cols]`) of the
/// layer's calibration inputs (any positive multiple of it: only its
/// shape matters).
pub fn gptq(
    pool: &ThreadPool,
    format: &Int4,
    rows: usize,
    cols: usize,
    w: &[f32],
    h: &[f32],
    opts: &GptqOptions,
) -> Result<Int4Weights> {
    if w.len() != rows * cols || h.len() != cols * cols {
        bail_arg!(
            "GPTQ: weights [{rows}, {cols}] and Hessian [{cols}, {cols}] do not match the data"
        );
    }
    if !(opts.damp > 0.0 && opts.damp.is_finite()) {
        bail_arg!("GPTQ damping must be positive, got {}", opts.damp);
    }
    let group = format.group_for(cols);
    let ng = groups_per_row(cols, group);
    let diag: Vec<f32> = (0..cols).map(|i| h[i * cols + i]).collect();
    let dead: Vec<bool> = diag.iter().map(|&d| d <= 0.0).collect();
    let perm: Vec<usize> = if opts.act_order {
        let mut p: Vec<usize> = (0..cols).collect();
        p.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]));
        p
    } else {
        (0..cols).collect()
    };
    // H and W with inputs in quantization order.
    let mut hp = vec![0f64; cols * cols];
    for (i, &pi) in perm.iter().enumerate() {
        for (j, &pj) in perm.iter().enumerate() {
            hp[i * cols + j] = f64::from(h[pi * cols + pj]);
        }
        if dead[pi] {
            hp[i * cols + i] = 1.0;
        }
    }
    let mean_diag = (0..cols).map(|i| hp[i * cols + i]).sum::<f64>() / cols as f64;
    let mut damp = opts.damp as f64 * mean_diag;
    let hinv = loop {
        let mut damped = hp.clone();
        for i in 0..cols {
            damped[i * cols + i] += damp;
        }
        match inverse_upper_cholesky(&damped, cols) {
            Ok(u) => break u,
            // f32 round-off on a near-singular Hessian: damp harder, as
            // GPTQModel does, rather than give up.
            Err(_) if damp < mean_diag => damp *= 10.0,
            Err(e) => bail_arg!(
                "GPTQ: the damped Hessian has no Cholesky factor: {}",
                e.message
            ),
        }
    };
    let mut wp = vec![0f32; rows * cols];
    for r in 0..rows {
        for (i, &pi) in perm.iter().enumerate() {
            wp[r * cols + i] = if dead[pi] { 0.0 } else { w[r * cols + pi] };
        }
    }

    let mut qp = vec![0u8; rows * cols];
    let mut zeros = vec![0u8; rows * ng];
    let mut scales = vec![0u16; rows * ng];
    type Tile<'a> = (&'a mut [f32], &'a mut [u8], &'a mut [u8], &'a mut [u16]);
    let tiles: Vec<Mutex<Tile<'_>>> = wp
        .chunks_mut(TILE * cols)
        .zip(qp.chunks_mut(TILE * cols))
        .zip(zeros.chunks_mut(TILE * ng))
        .zip(scales.chunks_mut(TILE * ng))
        .map(|(((a, b), c), d)| Mutex::new((a, b, c, d)))
        .collect();
    let failure: Mutex<Option<crate::Error>> = Mutex::new(None);
    pool.run(tiles.len(), &|t| {
        let mut guard = tiles[t].lock().unwrap_or_else(|e| e.into_inner());
        let (w, q, z, s) = &mut *guard;
        if let Err(e) = quantize_tile(format, cols, group, ng, &hinv, w, q, z, s) {
            *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    });
    drop(tiles);
    if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    // Back to the checkpoint's input order.
    let mut q = vec![0u8; rows * cols];
    for r in 0..rows {
        for (i, &pi) in perm.iter().enumerate() {
            q[r * cols + pi] = qp[r * cols + i];
        }
    }
    let g_idx = opts.act_order.then(|| {
        let mut g = vec![0i32; cols];
        for (i, &pi) in perm.iter().enumerate() {
            g[pi] = (i / group) as i32;
        }
        g
    });
    Ok(Int4Weights {
        rows,
        cols,
        group,
        q,
        zeros,
        scales,
        g_idx,
    })
}

multiversion!(
    /// GPTQ of the rows of one tile (`w`: `[tile rows, cols]`, in quantization order).
    #[allow(clippy::too_many_arguments)]
    fn quantize_tile(format: &Int4, cols: usize, group: usize, ng: usize, hinv: &[f32], w: &mut [f32], q: &mut [u8], zeros: &mut [u8], scales: &mut [u16]) -> Result<()> = quantize_tile_body
);

/// The body of [`quantize_tile`], compiled per vector width (the same bits on every CPU).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn quantize_tile_body(
    format: &Int4,
    cols: usize,
    group: usize,
    ng: usize,
    hinv: &[f32],
    w: &mut [f32],
    q: &mut [u8],
    zeros: &mut [u8],
    scales: &mut [u16],
) -> Result<()> {
    let n = w.len() / cols;
    let mut params = [(0f32, 0u8); TILE];
    let mut err = [0f32; TILE];
    for i in 0..cols {
        let g = i / group;
        let d = hinv[i * cols + i];
        for r in 0..n {
            let row = &w[r * cols..(r + 1) * cols];
            if i % group == 0 {
                let wg = &row[i..(i + group).min(cols)];
                let lo = wg.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let hi = wg.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let (scale, zero) = format.group_params(lo, hi)?;
                params[r] = (scale, zero);
                zeros[r * ng + g] = zero;
                scales[r * ng + g] = half::f16::from_f32(scale).to_bits();
            }
            let (scale, zero) = params[r];
            let v = row[i];
            q[r * cols + i] = quantize_value(v, scale, zero);
            err[r] = (v - fake_quantize(v, scale, zero)) / d;
        }
        let hrow = &hinv[i * cols + i + 1..(i + 1) * cols];
        for r in 0..n {
            if err[r] != 0.0 {
                axpy(-err[r], hrow, &mut w[r * cols + i + 1..(r + 1) * cols]);
            }
        }
    }
    Ok(())
}

/// GPTQ of one decoder block, true-sequential: each stage's linears are
/// quantized from the inputs produced by the already-quantized stages
/// before them, and the block's output (the next block's input) comes from
/// the quantized block. Returns the quantized weights in
/// [`Linear::ALL`](super::calib::Linear::ALL) order.
pub fn gptq_layer(
    fwd: &CalibForward<'_>,
    config: &crate::model::config::ModelConfig,
    format: &Int4,
    opts: &GptqOptions,
    l: &mut LayerWeights,
    h: &mut [f32],
) -> Result<Vec<Int4Weights>> {
    let n = fwd.tokens();
    let mut done: Vec<Option<Int4Weights>> = vec![None; 7];
    fwd.layer(l, h, &mut |stage: Stage,
                          x: &[f32],
                          l: &mut LayerWeights| {
        let cols = x.len() / n;
        let hess = gram(fwd.pool(), x, n, cols);
        for &lin in stage.linears() {
            let (rows, c) = lin.shape(config);
            debug_assert_eq!(c, cols);
            let qw = gptq(fwd.pool(), format, rows, cols, l.weight(lin), &hess, opts)?;
            *l.weight_mut(lin) = qw.dequantize();
            done[lin as usize] = Some(qw);
        }
        Ok(())
    })?;
    done.into_iter()
        .map(|q| q.ok_or_else(|| crate::Error::internal("GPTQ: a linear layer was not reached")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        }
    }

    /// `‖X (W − Ŵ)ᵀ‖²`.
    fn output_error(x: &[f32], n: usize, cols: usize, w: &[f32], wq: &[f32]) -> f64 {
        let rows = w.len() / cols;
        let mut e = 0f64;
        for t in 0..n {
            for r in 0..rows {
                let d: f64 = (0..cols)
                    .map(|c| x[t * cols + c] as f64 * (w[r * cols + c] - wq[r * cols + c]) as f64)
                    .sum();
                e += d * d;
            }
        }
        e
    }

    #[test]
    fn gptq_beats_round_to_nearest_on_the_layer_output() {
        let (rows, cols, n) = (16, 128, 256);
        let mut rng = Rng(11);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.next()).collect();
        // Correlated inputs with a few large channels, as activations have.
        let base: Vec<f32> = (0..n * 8).map(|_| rng.next()).collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let (t, c) = (i / cols, i % cols);
                let amp = if c % 17 == 0 { 8.0 } else { 1.0 };
                amp * (base[t * 8 + c % 8] + 0.3 * rng.next())
            })
            .collect();
        let pool = ThreadPool::new(2);
        let h = gram(&pool, &x, n, cols);
        for format in [
            Int4::gptq(32, true).unwrap(),
            Int4::gptq(64, false).unwrap(),
            Int4::awq(32).unwrap(),
        ] {
            let rtn = format.rtn_weights(rows, cols, &w).unwrap().dequantize();
            let e_rtn = output_error(&x, n, cols, &w, &rtn);
            for act_order in [false, true] {
                let opts = GptqOptions {
                    act_order,
                    ..Default::default()
                };
                let g = gptq(&pool, &format, rows, cols, &w, &h, &opts).unwrap();
                assert_eq!(g.g_idx.is_some(), act_order);
                if let Some(gi) = &g.g_idx {
                    let mut count = vec![0; cols / 32];
                    gi.iter().for_each(|&x| count[x as usize] += 1);
                    assert!(count.iter().all(|&c| c == 0 || c == format.group_for(cols)));
                }
                let e = output_error(&x, n, cols, &w, &g.dequantize());
                assert!(
                    e < 0.7 * e_rtn,
                    "{format:?} act_order={act_order}: GPTQ {e} vs RTN {e_rtn}"
                );
            }
        }
    }

    #[test]
    fn dead_inputs_are_zeroed_and_bad_damping_fails() {
        let (rows, cols) = (8, 32);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut h = vec![0f32; cols * cols];
        for i in 1..cols {
            h[i * cols + i] = 1.0 + i as f32;
        }
        let pool = ThreadPool::new(1);
        let f = Int4::gptq(32, false).unwrap();
        let g = gptq(&pool, &f, rows, cols, &w, &h, &GptqOptions::default()).unwrap();
        let deq = g.dequantize();
        for r in 0..rows {
            assert!(deq[r * cols].abs() <= 0.5 * f16_scale(&g, r) + 1e-6);
        }
        let bad = GptqOptions {
            damp: 0.0,
            ..Default::default()
        };
        assert!(gptq(&pool, &f, rows, cols, &w, &h, &bad).is_err());
    }

    fn f16_scale(g: &Int4Weights, r: usize) -> f32 {
        half::f16::from_bits(g.scales[r]).to_f32()
    }
}
