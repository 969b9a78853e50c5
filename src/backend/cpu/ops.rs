//! Element-wise and per-row ops of the decoder: RMSNorm, RoPE, SwiGLU, residual add.

/// out[r] = x[r] / rms(x[r]) · weight, for each row of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = super::vector::dot(xr, xr);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// In-place RMSNorm of each `weight.len()`-wide chunk (Qwen3's per-head q/k norm).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for xr in x.chunks_exact_mut(d) {
        let ss: f32 = super::vector::dot(xr, xr);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for (v, w) in xr.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// Rotates each `head_dim`-wide head of `x` (HF "rotate_half" layout) by the
/// angles whose cos/sin are given for the first half of the head.
pub fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x0, x1) = (a[i], b[i]);
            a[i] = x0 * cos[i] - x1 * sin[i];
            b[i] = x1 * cos[i] + x0 * sin[i];
        }
    }
}

pub use super::vector::{silu_mul, softmax_in_place};

/// x[i] += y[i].
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 6.0, 8.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
        assert!((out[2] - 3.0 / rms).abs() < 1e-6 && (out[3] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs() {
        let mut x = [1.0, 0.0, 0.0, 1.0];
        let (c, s) = (0.6f32, 0.8f32);
        apply_rope(&mut x, 4, &[c, 1.0], &[s, 0.0]);
        assert!((x[0] - 0.6).abs() < 1e-6 && (x[2] - 0.8).abs() < 1e-6);
        assert!((x[1] - 0.0).abs() < 1e-6 && (x[3] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0, 2.0, 3.0, -1e30];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] == 0.0);
    }
}
