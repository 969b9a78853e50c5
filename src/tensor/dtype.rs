//! Element types of weights and activations.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I8,
    I32,
    /// FP8 E4M3 (`float8_e4m3fn`): only as an FP8 checkpoint's weights,
    /// read with their scales (`model::quant_fp8`).
    F8E4M3,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::F8E4M3 => 1,
        }
    }

    /// Parses a safetensors dtype tag ("F32", "BF16", ...); `None` for tags
    /// that are unknown or that this engine cannot compute with.
    pub fn from_safetensors(tag: &str) -> Option<DType> {
        SafetensorsDType::from_tag(tag)?.to_dtype()
    }

    pub fn safetensors_tag(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I8 => "I8",
            DType::I32 => "I32",
            DType::F8E4M3 => "F8_E4M3",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::F8E4M3 => "f8_e4m3",
        })
    }
}

/// Every element type the safetensors format defines, so that headers naming
/// any of them can be validated (sizes checked) even though the engine only
/// computes with the subset that maps onto [`DType`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SafetensorsDType {
    Bool,
    /// MXFP4 (4 bits per element).
    F4,
    /// MXFP6 variants (6 bits per element).
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl SafetensorsDType {
    const ALL: [SafetensorsDType; 19] = [
        SafetensorsDType::Bool,
        SafetensorsDType::F4,
        SafetensorsDType::F6E2M3,
        SafetensorsDType::F6E3M2,
        SafetensorsDType::U8,
        SafetensorsDType::I8,
        SafetensorsDType::F8E5M2,
        SafetensorsDType::F8E4M3,
        SafetensorsDType::F8E8M0,
        SafetensorsDType::I16,
        SafetensorsDType::U16,
        SafetensorsDType::F16,
        SafetensorsDType::BF16,
        SafetensorsDType::I32,
        SafetensorsDType::U32,
        SafetensorsDType::F32,
        SafetensorsDType::F64,
        SafetensorsDType::I64,
        SafetensorsDType::U64,
    ];

    /// Parses the tag exactly as written in a safetensors header ("BF16", "F8_E4M3", ...).
    pub fn from_tag(tag: &str) -> Option<SafetensorsDType> {
        Self::ALL.into_iter().find(|d| d.tag() == tag)
    }

    pub fn tag(self) -> &'static str {
        match self {
            SafetensorsDType::Bool => "BOOL",
            SafetensorsDType::F4 => "F4",
            SafetensorsDType::F6E2M3 => "F6_E2M3",
            SafetensorsDType::F6E3M2 => "F6_E3M2",
            SafetensorsDType::U8 => "U8",
            SafetensorsDType::I8 => "I8",
            SafetensorsDType::F8E5M2 => "F8_E5M2",
            SafetensorsDType::F8E4M3 => "F8_E4M3",
            SafetensorsDType::F8E8M0 => "F8_E8M0",
            SafetensorsDType::I16 => "I16",
            SafetensorsDType::U16 => "U16",
            SafetensorsDType::F16 => "F16",
            SafetensorsDType::BF16 => "BF16",
            SafetensorsDType::I32 => "I32",
            SafetensorsDType::U32 => "U32",
            SafetensorsDType::F32 => "F32",
            SafetensorsDType::F64 => "F64",
            SafetensorsDType::I64 => "I64",
            SafetensorsDType::U64 => "U64",
        }
    }

    /// Size of one element in bits (F4 and F6 are smaller than a byte).
    pub fn bits(self) -> usize {
        match self {
            SafetensorsDType::F4 => 4,
            SafetensorsDType::F6E2M3 | SafetensorsDType::F6E3M2 => 6,
            SafetensorsDType::Bool
            | SafetensorsDType::U8
            | SafetensorsDType::I8
            | SafetensorsDType::F8E5M2
            | SafetensorsDType::F8E4M3
            | SafetensorsDType::F8E8M0 => 8,
            SafetensorsDType::I16
            | SafetensorsDType::U16
            | SafetensorsDType::F16
            | SafetensorsDType::BF16 => 16,
            SafetensorsDType::I32 | SafetensorsDType::U32 | SafetensorsDType::F32 => 32,
            SafetensorsDType::F64 | SafetensorsDType::I64 | SafetensorsDType::U64 => 64,
        }
    }

    /// Bytes taken by `numel` elements; `None` on overflow or when the bits
    /// do not fill a whole number of bytes.
    pub fn byte_size(self, numel: usize) -> Option<usize> {
        let bits = numel.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// The engine dtype with the same encoding, if the engine supports it.
    pub fn to_dtype(self) -> Option<DType> {
        Some(match self {
            SafetensorsDType::F32 => DType::F32,
            SafetensorsDType::F16 => DType::F16,
            SafetensorsDType::BF16 => DType::BF16,
            SafetensorsDType::I8 => DType::I8,
            SafetensorsDType::I32 => DType::I32,
            SafetensorsDType::F8E4M3 => DType::F8E4M3,
            _ => return None,
        })
    }
}

impl From<DType> for SafetensorsDType {
    fn from(dtype: DType) -> Self {
        match dtype {
            DType::F32 => SafetensorsDType::F32,
            DType::F16 => SafetensorsDType::F16,
            DType::BF16 => SafetensorsDType::BF16,
            DType::I8 => SafetensorsDType::I8,
            DType::I32 => SafetensorsDType::I32,
            DType::F8E4M3 => SafetensorsDType::F8E4M3,
        }
    }
}

impl fmt::Display for SafetensorsDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.tag())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_sizes_match_dtype() {
        for d in SafetensorsDType::ALL {
            assert_eq!(SafetensorsDType::from_tag(d.tag()), Some(d));
            if let Some(engine) = d.to_dtype() {
                assert_eq!(engine.size_in_bytes() * 8, d.bits());
                assert_eq!(engine.safetensors_tag(), d.tag());
                assert_eq!(SafetensorsDType::from(engine), d);
            }
        }
        assert_eq!(SafetensorsDType::from_tag("f32"), None);
        assert_eq!(DType::from_safetensors("F64"), None);
        assert_eq!(DType::from_safetensors("BF16"), Some(DType::BF16));
    }

    #[test]
    fn byte_size_checks_overflow_and_sub_byte_remainders() {
        assert_eq!(SafetensorsDType::F32.byte_size(3), Some(12));
        assert_eq!(SafetensorsDType::F4.byte_size(4), Some(2));
        assert_eq!(SafetensorsDType::F4.byte_size(3), None);
        assert_eq!(SafetensorsDType::F6E2M3.byte_size(4), Some(3));
        assert_eq!(SafetensorsDType::F64.byte_size(usize::MAX / 8), None);
    }
}
