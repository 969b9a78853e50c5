//! aarch64 NEON versions of the f32 vector kernels of `vector.rs`: dot
//! product, axpy, SiLU·mul, the unnormalized softmax, and the int8
//! activation quantizer of `q8.rs`. Every aarch64 CPU has NEON, so these
//! need no feature check beyond the target; `vector.rs` picks them when the
//! ISA is [`Isa::Neon`](super::isa::Isa::Neon).

use std::arch::aarch64::*;

/// Σ a[i]·b[i] for i < n.
///
/// # Safety
/// `a` and `b` hold `n` values.
pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (l, acc_l) in acc.iter_mut().enumerate() {
            let j = i + 4 * l;
            *acc_l = vfmaq_f32(*acc_l, vld1q_f32(a.add(j)), vld1q_f32(b.add(j)));
        }
        i += 16;
    }
    while i + 4 <= n {
        acc[0] = vfmaq_f32(acc[0], vld1q_f32(a.add(i)), vld1q_f32(b.add(i)));
        i += 4;
    }
    let sum = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    let mut s = vaddvq_f32(sum);
    while i < n {
        s += *a.add(i) * *b.add(i);
        i += 1;
    }
    s
}

/// y[i] += alpha · x[i] for i < n.
///
/// # Safety
/// `x` and `y` hold `n` values.
pub unsafe fn axpy(alpha: f32, x: *const f32, y: *mut f32, n: usize) {
    let mut i = 0;
    while i + 8 <= n {
        let y0 = vfmaq_n_f32(vld1q_f32(y.add(i)), vld1q_f32(x.add(i)), alpha);
        let y1 = vfmaq_n_f32(vld1q_f32(y.add(i + 4)), vld1q_f32(x.add(i + 4)), alpha);
        vst1q_f32(y.add(i), y0);
        vst1q_f32(y.add(i + 4), y1);
        i += 8;
    }
    while i < n {
        *y.add(i) += alpha * *x.add(i);
        i += 1;
    }
}

/// e^x for each lane: a few ulp from libm above -87, exactly 0 below (the
/// polynomial of `vector.rs`'s AVX-512 `exp512`).
#[inline]
#[target_feature(enable = "neon")]
pub fn exp4(x: float32x4_t) -> float32x4_t {
    let keep = vcgeq_f32(x, vdupq_n_f32(-87.0));
    let x = vmaxq_f32(x, vdupq_n_f32(-87.0));
    // n = round(x · log2 e), ties to even as AVX's roundscale.
    let n = vrndnq_f32(vmulq_n_f32(x, std::f32::consts::LOG2_E));
    // r = x - n·ln2 in two steps (Cody–Waite).
    let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_145_75));
    let r = vfmsq_f32(r, n, vdupq_n_f32(1.428_606_8e-6));
    let mut p = vdupq_n_f32(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    // p · 2^n: n ∈ [-126, 128), so 2^n is a normal f32 up to 2^127 and the
    // top case splits in two factors.
    let ni = vcvtq_s32_f32(n);
    let half = vshrq_n_s32::<1>(ni);
    let scale =
        |e: int32x4_t| vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(e, vdupq_n_s32(127))));
    let v = vmulq_f32(vmulq_f32(p, scale(half)), scale(vsubq_s32(ni, half)));
    vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), keep))
}

/// `x[i] = exp(x[i] - max)`; returns `1 / Σ x[i]`.
///
/// # Safety
/// `x` must not be empty.
pub unsafe fn softmax_unnormalized(x: &mut [f32]) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let full = n / 4 * 4;
    let mut mx = vdupq_n_f32(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        mx = vmaxq_f32(mx, vld1q_f32(p.add(i)));
        i += 4;
    }
    let mut m = vmaxvq_f32(mx);
    for &v in &x[full..] {
        m = m.max(v);
    }
    let mv = vdupq_n_f32(m);
    let mut sum = vdupq_n_f32(0.0);
    i = 0;
    while i < full {
        let e = exp4(vsubq_f32(vld1q_f32(p.add(i)), mv));
        vst1q_f32(p.add(i), e);
        sum = vaddq_f32(sum, e);
        i += 4;
    }
    if full < n {
        // The tail through one padded vector, so it gets the same exp.
        let mut tail = [f32::NEG_INFINITY; 4];
        tail[..n - full].copy_from_slice(&x[full..]);
        let e = exp4(vsubq_f32(vld1q_f32(tail.as_ptr()), mv));
        vst1q_f32(tail.as_mut_ptr(), e);
        x[full..].copy_from_slice(&tail[..n - full]);
        sum = vaddq_f32(sum, e);
    }
    1.0 / vaddvq_f32(sum)
}

/// o[i] = silu(g[i]) · u[i] for i < n / 4 · 4; returns how many it wrote.
///
/// # Safety
/// The three pointers hold `n` values.
pub unsafe fn silu_mul(g: *const f32, u: *const f32, o: *mut f32, n: usize) -> usize {
    let one = vdupq_n_f32(1.0);
    let mut i = 0;
    while i + 4 <= n {
        let gv = vld1q_f32(g.add(i));
        let e = exp4(vnegq_f32(gv));
        let s = vdivq_f32(gv, vaddq_f32(one, e));
        vst1q_f32(o.add(i), vmulq_f32(s, vld1q_f32(u.add(i))));
        i += 4;
    }
    i
}

/// `q[j] = clamp(round(x[j] · inv), ±127)` for j < n / 8 · 8, rounding
/// halves away from zero as `f32::round` does (`fcvtas`), so the bytes are
/// the scalar quantizer's; returns how many it wrote.
///
/// # Safety
/// `x` and `q` hold `n` values.
pub unsafe fn quantize_i8(x: *const f32, inv: f32, q: *mut i8, n: usize) -> usize {
    let (lo, hi) = (vdupq_n_f32(-127.0), vdupq_n_f32(127.0));
    let mut i = 0;
    while i + 8 <= n {
        let mut w = [vdupq_n_s32(0); 2];
        for (h, wh) in w.iter_mut().enumerate() {
            let v = vmulq_n_f32(vld1q_f32(x.add(i + 4 * h)), inv);
            // Clamp before converting; fmax/fmin keep a NaN, which fcvtas
            // turns into 0 (as `f32 as i8` does).
            let c = vminq_f32(vmaxq_f32(v, lo), hi);
            *wh = vcvtaq_s32_f32(c);
        }
        let w16 = vcombine_s16(vmovn_s32(w[0]), vmovn_s32(w[1]));
        vst1_s8(q.add(i), vmovn_s16(w16));
        i += 8;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let xs: Vec<f32> = (0..1440).map(|i| -(i as f32) * 0.06).collect();
        for chunk in xs.chunks(4) {
            let mut out = [0f32; 4];
            // SAFETY: chunk has 4 values, out has room for 4.
            unsafe { vst1q_f32(out.as_mut_ptr(), exp4(vld1q_f32(chunk.as_ptr()))) };
            for (x, e) in chunk.iter().zip(out) {
                let want = x.exp();
                assert!(
                    (e - want).abs() <= 4e-7 * want + 1e-38,
                    "exp({x}) = {e}, want {want}"
                );
            }
        }
        let mut out = [0f32; 4];
        let big = [88.0f32, 10.0, -87.5, f32::NEG_INFINITY];
        // SAFETY: as above.
        unsafe { vst1q_f32(out.as_mut_ptr(), exp4(vld1q_f32(big.as_ptr()))) };
        assert!((out[0] - 88f32.exp()).abs() <= 4e-7 * 88f32.exp());
        assert!((out[1] - 10f32.exp()).abs() <= 4e-7 * 10f32.exp());
        assert_eq!(&out[2..], &[0.0, 0.0]);
    }

    #[test]
    fn quantizer_gives_the_scalar_bytes() {
        let x: Vec<f32> = (0..203)
            .map(|i| match i {
                7 => f32::NAN,
                8 => f32::INFINITY,
                9 => -1e9,
                // Exact halves after scaling by 2: ties away from zero.
                _ => (i as f32 - 100.0) * 0.75,
            })
            .collect();
        let inv = 2.0;
        let mut q = vec![0i8; x.len()];
        // SAFETY: both slices hold x.len() values.
        let done = unsafe { quantize_i8(x.as_ptr(), inv, q.as_mut_ptr(), x.len()) };
        assert_eq!(done, 200);
        for (j, (&v, &got)) in x.iter().zip(&q).take(done).enumerate() {
            let want = (v * inv).round().clamp(-127.0, 127.0) as i8;
            assert_eq!(got, want, "{j}: {v}");
        }
    }
}
