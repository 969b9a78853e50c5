//! Finding NaN and infinity in float data, in one vectorized pass: weights
//! at load, logits before sampling.

/// Elements per step of the scan: a branch per 16 elements, bit tests
/// in between, which the compiler turns into vector compares.
const LANES: usize = 16;

/// Index of the first element of `xs` for which `bad` holds.
fn first_where<T: Copy>(xs: &[T], bad: impl Fn(T) -> bool) -> Option<usize> {
    let chunks = xs.chunks_exact(LANES);
    let tail_start = xs.len() - chunks.remainder().len();
    for (ci, c) in chunks.enumerate() {
        if c.iter().fold(false, |hit, &x| hit | bad(x)) {
            return c.iter().position(|&x| bad(x)).map(|i| ci * LANES + i);
        }
    }
    xs[tail_start..]
        .iter()
        .position(|&x| bad(x))
        .map(|i| tail_start + i)
}

/// Index of the first NaN or infinity (all exponent bits set) in `xs`.
pub fn first_non_finite(xs: &[f32]) -> Option<usize> {
    first_where(xs, |x: f32| x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
}

/// Like [`first_non_finite`] for raw bfloat16 bits.
pub fn first_non_finite_bf16(bits: &[u16]) -> Option<usize> {
    first_where(bits, |b: u16| b & 0x7f80 == 0x7f80)
}

/// Like [`first_non_finite`] for raw IEEE half bits.
pub fn first_non_finite_f16(bits: &[u16]) -> Option<usize> {
    first_where(bits, |b: u16| b & 0x7c00 == 0x7c00)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn finds_the_first_nan_or_infinity_anywhere() {
        for len in [0usize, 1, 15, 16, 17, 100] {
            let clean = vec![1.0f32; len];
            assert_eq!(first_non_finite(&clean), None);
            for at in [0, len / 2, len.saturating_sub(1)]
                .into_iter()
                .filter(|&i| i < len)
            {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut x = clean.clone();
                    x[at] = bad;
                    if at + 1 < len {
                        x[len - 1] = bad;
                    }
                    assert_eq!(first_non_finite(&x), Some(at), "{len} {at} {bad}");
                    let b: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
                    assert_eq!(first_non_finite_bf16(&b), Some(at));
                    let h: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
                    assert_eq!(first_non_finite_f16(&h), Some(at));
                }
            }
        }
        // Huge but finite values are not flagged.
        assert_eq!(
            first_non_finite(&[f32::MAX, -f32::MAX, f32::MIN_POSITIVE]),
            None
        );
        assert_eq!(first_non_finite_f16(&[f16::MAX.to_bits()]), None);
        assert_eq!(first_non_finite_bf16(&[bf16::MAX.to_bits()]), None);
    }
}
