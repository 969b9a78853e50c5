//! FP8 E4M3 as torch's `float8_e4m3fn` and safetensors' `F8_E4M3` store it
//! (the OCP "fn" variant: 4 exponent bits with bias 7, 3 mantissa bits, no
//! infinities, NaN = `S.1111.111`, largest finite ±448).
//!
//! Written here rather than taken from a crate: the codec is one decode
//! formula and one rounding function, and the conversions must match torch's
//! bit for bit (round to nearest, ties to even), which a unit test pins.

use once_cell::sync::Lazy;

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The code of +NaN (and, with the sign bit, -NaN).
const NAN_CODE: u8 = 0x7f;

static DECODE: Lazy<[f32; 256]> = Lazy::new(|| std::array::from_fn(|b| decode(b as u8)));

fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0x0f) as i32, (b & 0x07) as f32);
    if b & 0x7f == NAN_CODE {
        return f32::NAN;
    }
    if e == 0 {
        // Subnormal: m/8 · 2^-6.
        sign * m * 2f32.powi(-9)
    } else {
        sign * (8.0 + m) * 2f32.powi(e - 10)
    }
}

/// The value of an E4M3 code.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    DECODE[b as usize]
}

/// The E4M3 code nearest `x` (ties to an even mantissa), saturating at
/// ±448 as quantizers clamp before converting; NaN stays NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    let min_normal = 2f32.powi(-6);
    if a < min_normal {
        // Subnormals are multiples of 2^-9; scaling by 512 is exact, and a
        // result of 8 is the code of the smallest normal.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // a = r · 2^e with r in [1, 2): the exponent from the f32 bits.
    let mut e = ((a.to_bits() >> 23) as i32) - 127;
    // 2^-e built from its bits (e in -6..=8): exact, and cheaper than powi
    // for the hundreds of millions of weights a load may quantize.
    let r = a * f32::from_bits(((127 - e) as u32) << 23);
    let mut m = ((r - 1.0) * 8.0).round_ties_even() as u8;
    if m == 8 {
        e += 1;
        m = 0;
    }
    // e <= 8 here (a < 448), so the code stays at or below 0x7e.
    sign | (((e + 7) as u8) << 3) | m
}

/// An FP8 matrix as the backends take it: row-major E4M3 codes
/// `[rows, cols]` and one f32 scale per row and group of `group_cols`
/// consecutive columns (`[rows, groups]`, row-major). Every scale layout of
/// a checkpoint expands to it: a block of `bn × bk` repeats its scale over
/// `bn` rows with `group_cols = bk`; per-channel and per-tensor scales have
/// one group per row. Rows stack (fused projections) by concatenation.
#[derive(Debug, Clone)]
pub struct Fp8Rows {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub group_cols: usize,
}

impl Fp8Rows {
    /// Scale groups per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_cols)
    }

    /// The scale of weight `(r, c)`.
    #[inline]
    pub fn scale(&self, r: usize, c: usize) -> f32 {
        self.scales[r * self.groups() + c / self.group_cols]
    }

    /// Row `r`'s values (`code · scale`, rounded once to f32).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let codes = &self.codes[r * self.cols..(r + 1) * self.cols];
        for (c, (o, &b)) in out.iter_mut().zip(codes).enumerate() {
            *o = e4m3_to_f32(b) * self.scale(r, c);
        }
    }

    /// Index of the first weight whose value is not finite: a NaN code, or
    /// a code times a scale that overflows f32 (or is NaN).
    pub fn first_non_finite(&self) -> Option<usize> {
        let nan = self.codes.iter().position(|&b| b & 0x7f == NAN_CODE);
        let groups = self.groups();
        // Only a scale for which the largest code overflows can make one.
        let overflow = (0..self.rows * groups)
            .filter(|&i| !(self.scales[i] * E4M3_MAX).is_finite())
            .filter_map(|i| {
                let (r, g) = (i / groups, i % groups);
                let c0 = g * self.group_cols;
                let c1 = (c0 + self.group_cols).min(self.cols);
                (c0..c1)
                    .find(|&c| {
                        !(e4m3_to_f32(self.codes[r * self.cols + c]) * self.scales[i]).is_finite()
                    })
                    .map(|c| r * self.cols + c)
            })
            .min();
        match (nan, overflow) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Bytes a full pass over the weights reads (codes and scales).
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_decode_to_their_values() {
        for (code, want) in [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x7e, 448.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
        ] {
            assert_eq!(e4m3_to_f32(code), want, "code {code:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0..=255u8 {
            if b & 0x7f != NAN_CODE {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "code {b:#04x}");
            }
        }
    }

    /// Between two neighbouring codes: below the midpoint the lower, above
    /// it the upper, at it the even mantissa (torch's rounding).
    #[test]
    fn rounding_is_to_nearest_with_ties_to_even() {
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "tie between {b:#04x} and the next");
            assert_eq!(f32_to_e4m3(mid - (hi - lo) / 8.0), b);
            assert_eq!(f32_to_e4m3(mid + (hi - lo) / 8.0), b + 1);
            assert_eq!(f32_to_e4m3(-mid), 0x80 | even);
        }
    }

    #[test]
    fn large_values_saturate_and_nan_stays_nan() {
        assert_eq!(f32_to_e4m3(449.0), 0x7e);
        assert_eq!(f32_to_e4m3(1e30), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3(1e-10), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
    }

    #[test]
    fn fp8_rows_scale_by_group_and_name_the_first_non_finite_weight() {
        // 2 rows × 4 columns in groups of 2: scales [[1, 2], [0.5, 4]].
        let mut m = Fp8Rows {
            rows: 2,
            cols: 4,
            codes: [0x38u8, 0x40, 0x38, 0x40, 0x38, 0xb8, 0x00, 0x38].to_vec(),
            scales: vec![1.0, 2.0, 0.5, 4.0],
            group_cols: 2,
        };
        let mut row = [0f32; 4];
        m.row_to_f32(0, &mut row);
        assert_eq!(row, [1.0, 2.0, 2.0, 4.0]);
        m.row_to_f32(1, &mut row);
        assert_eq!(row, [0.5, -0.5, 0.0, 4.0]);
        assert_eq!(m.first_non_finite(), None);
        // A scale whose largest code would overflow: every weight of its
        // group is checked (0 · inf is NaN too).
        m.scales[3] = f32::INFINITY;
        assert_eq!(m.first_non_finite(), Some(6));
        m.codes[5] = 0xff; // -NaN, earlier in the matrix
        assert_eq!(m.first_non_finite(), Some(5));
        assert_eq!(m.size_in_bytes(), 8 + 16);
    }
}
