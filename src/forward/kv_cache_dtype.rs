//! The element type of a session's KV cache, and the FP8 (e4m3) format of
//! the 8-bit one: the host side of what the CUDA kernels store and load
//! (`kernels/decoder.cu`, "The FP8 KV cache").

use std::fmt;
use std::str::FromStr;

/// What a session's KV cache stores keys and values as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvCacheDType {
    /// The model's activation dtype (CUDA: bf16 or f16; CPU: f32).
    #[default]
    Auto,
    /// OCP FP8 e4m3fn, unscaled (vLLM's `kv_cache_dtype="fp8"` with scale
    /// 1): half the bytes of a 16-bit cache, so twice the tokens in the same
    /// memory and half the bytes decode attention reads. CUDA only.
    Fp8E4m3,
}

impl KvCacheDType {
    /// Bytes of one key or value element, given the activation element's.
    pub fn element_bytes(self, activation_bytes: usize) -> usize {
        match self {
            KvCacheDType::Auto => activation_bytes,
            KvCacheDType::Fp8E4m3 => 1,
        }
    }
}

impl fmt::Display for KvCacheDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvCacheDType::Auto => "auto",
            KvCacheDType::Fp8E4m3 => "fp8",
        })
    }
}

impl FromStr for KvCacheDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KvCacheDType::Auto),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvCacheDType::Fp8E4m3),
            _ => Err(format!(
                "unknown KV cache dtype {s:?} (expected auto or fp8)"
            )),
        }
    }
}

/// The largest finite e4m3 value; larger magnitudes saturate to it.
pub const E4M3_MAX: f32 = 448.0;

/// The e4m3fn byte of `v`: round to nearest even, saturating at ±448; NaN
/// stays NaN (0x7f with v's sign).
pub fn e4m3_from_f32(v: f32) -> u8 {
    let sign = ((v.to_bits() >> 24) & 0x80) as u8;
    if v.is_nan() {
        return sign | 0x7f;
    }
    let a = v.abs().min(E4M3_MAX);
    if a < 2f32.powi(-6) {
        // Subnormals: steps of 2^-9; 8 steps is 0x08, the smallest normal.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut bits = a.to_bits();
    bits += 0x7ffff + ((bits >> 20) & 1); // 3 mantissa bits, nearest even
    let exponent = (bits >> 23) - 120; // bias 127 -> 7
    sign | ((exponent << 3) as u8) | ((bits >> 20) & 7) as u8
}

/// The value of an e4m3fn byte (0x7f / 0xff are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let magnitude = b & 0x7f;
    if magnitude == 0x7f {
        return f32::NAN;
    }
    let (exponent, mantissa) = ((magnitude >> 3) as i32, (magnitude & 7) as f32);
    let value = if exponent == 0 {
        mantissa * 2f32.powi(-9)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    if b & 0x80 != 0 {
        -value
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(v.is_nan());
            } else {
                assert_eq!(e4m3_from_f32(v), b, "code {b:#04x} = {v}");
            }
        }
    }

    #[test]
    fn known_values_and_rounding() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        // Halfway between 1 and 1.125 rounds to the even mantissa (1).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        // Halfway between 1.125 and 1.25 rounds up to the even one (1.25).
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        assert_eq!(e4m3_from_f32(1.05), 0x38);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        // A mantissa carry moves to the next binade: 1.9375 -> 2.
        assert_eq!(e4m3_from_f32(1.9375), 0x40);
        // Saturation, not infinity.
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-1e6), 0xfe);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7e);
        assert_eq!(e4m3_from_f32(f32::NAN) & 0x7f, 0x7f);
        // Subnormals, ties to even: half a step rounds to 0, 1.5 steps to 2.
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        // Just below the smallest normal rounds up into it.
        assert_eq!(e4m3_from_f32(2f32.powi(-6) * 0.99), 0x08);
    }

    #[test]
    fn parses_names() {
        assert_eq!("fp8".parse::<KvCacheDType>(), Ok(KvCacheDType::Fp8E4m3));
        assert_eq!(
            "FP8_E4M3".parse::<KvCacheDType>(),
            Ok(KvCacheDType::Fp8E4m3)
        );
        assert_eq!("auto".parse::<KvCacheDType>(), Ok(KvCacheDType::Auto));
        assert!("int8".parse::<KvCacheDType>().unwrap_err().contains("int8"));
    }
}
