//! Vocabulary-wide numeric kernels for the sampler, written so the compiler
//! can vectorize them (independent lanes, branch-free bodies). A vocabulary
//! row is ~50k floats and these run once or twice per sampled token.

const LANES: usize = 8;

/// `exp(x)` for f32 in the Cephes `expf` style: range reduction by
/// `n = round(x / ln 2)`, a degree-6 polynomial, then scaling by `2^n`.
/// Relative error below 3e-7 where the result is a normal float; returns 0 for
/// `x < -87.3` (including -inf and NaN) and saturates near `f32::MAX` above 88.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LO: f32 = -87.3;
    const HI: f32 = 88.3;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let p = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * z + r + 1.0;
    // The low mantissa bits of `t` hold `n` (offset by ROUND's bits): build
    // 2^n from them without a float-to-int conversion, which would not vectorize.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    // Branch-free select (keeps the loop vectorizable); `x >= LO` is false
    // for NaN, which therefore gives 0 too.
    let keep = ((x >= LO) as u32).wrapping_neg();
    f32::from_bits((y * scale).to_bits() & keep)
}

/// Largest value, ignoring NaN; -inf when empty or all NaN.
pub fn max(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    for &x in rest {
        m[0] = if x > m[0] { x } else { m[0] };
    }
    m.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Index of the largest value, lowest index on ties, NaN ignored; 0 when
/// `xs` is empty or all NaN.
pub fn argmax(xs: &[f32]) -> u32 {
    let m = max(xs);
    // Find the chunk holding the first `m` with a vectorizable test per chunk.
    let start = xs
        .chunks(LANES * 4)
        .position(|c| c.iter().fold(false, |hit, &x| hit | (x == m)))
        .map_or(xs.len(), |c| c * LANES * 4);
    xs[start..]
        .iter()
        .position(|&x| x == m)
        .map_or(0, |i| start + i) as u32
}

/// `sum(exp(x - shift))`, accumulated in f64 lanes. NaN entries add 0.
pub fn sum_exp(xs: &[f32], shift: f32) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        let mut e = [0f32; LANES];
        for j in 0..LANES {
            e[j] = exp_approx(c[j] - shift);
        }
        for j in 0..LANES {
            acc[j] += e[j] as f64;
        }
    }
    for &x in rest {
        acc[0] += exp_approx(x - shift) as f64;
    }
    acc.iter().sum()
}

/// Writes `exp(x - shift)` for every `x` into `out` (cleared first) and
/// returns their sum (f64 lanes). NaN entries give 0.
pub fn exp_into(xs: &[f32], shift: f32, out: &mut Vec<f32>) -> f64 {
    out.clear();
    out.extend(xs.iter().map(|&x| exp_approx(x - shift)));
    let mut acc = [0f64; LANES];
    let chunks = out.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j] as f64;
        }
    }
    for &w in rest {
        acc[0] += w as f64;
    }
    acc.iter().sum()
}

/// `ln(sum(exp(xs)))`; -inf when every entry is -inf (or NaN), +inf when one is.
pub fn log_sum_exp(xs: &[f32]) -> f32 {
    let m = max(xs);
    if !m.is_finite() {
        return m;
    }
    (m as f64 + sum_exp(xs, m).ln()) as f32
}

/// Refuses a logits row with a NaN or infinity: sampling it would pick
/// an arbitrary token (NaN never compares greater) with NaN logprobs.
pub fn check_finite_logits(row: &[f32]) -> crate::Result<()> {
    match crate::tensor::finite::first_non_finite(row) {
        None => Ok(()),
        Some(i) => Err(non_finite_logits(Some((i, row[i])))),
    }
}

/// The error that ends a request whose logits are not finite, naming the
/// first bad id and value when known.
pub fn non_finite_logits(at: Option<(usize, f32)>) -> crate::Error {
    let what = match at {
        Some((i, x)) => format!("{x} for token id {i}"),
        None => "NaN or infinity".to_string(),
    };
    crate::Error::invalid_model(format!(
        "non-finite logits: the model computed {what} (its weights or activations \
         overflowed); the request was stopped"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_accuracy() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let exact = (x as f64).exp();
            let rel = ((exp_approx(x) as f64 - exact) / exact).abs();
            worst = worst.max(rel);
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp_approx(0.0), 1.0);
    }

    #[test]
    fn exp_approx_edges() {
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_approx(f32::NAN), 0.0);
        assert_eq!(exp_approx(-100.0), 0.0);
        assert!(exp_approx(f32::INFINITY).is_finite());
        assert!(exp_approx(f32::INFINITY) > 1e38);
    }

    #[test]
    fn reductions() {
        let xs: Vec<f32> = (0..37).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.0).collect();
        assert_eq!(max(&xs), 3.0);
        assert_eq!(
            argmax(&xs),
            xs.iter().position(|&x| x == 3.0).unwrap() as u32
        );
        let exact: f64 = xs.iter().map(|&x| (x as f64 - 1.0).exp()).sum();
        assert!((sum_exp(&xs, 1.0) - exact).abs() / exact < 1e-6);
        let mut out = Vec::new();
        assert!((exp_into(&xs, 1.0, &mut out) - exact).abs() / exact < 1e-6);
        assert_eq!(out.len(), xs.len());
        let lse = exact.ln() + 1.0;
        assert!((log_sum_exp(&xs) as f64 - lse).abs() < 1e-6);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN, -1.0]), -1.0);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
    }
}
