//! Typed access to a tensor's bytes inside a mapped weight file: zero-copy
//! when dtype and alignment allow, a converted or copied buffer otherwise.
//!
//! Safetensors data is little-endian; so is every host this reads on.

#[cfg(not(target_endian = "little"))]
compile_error!("the safetensors reader reinterprets little-endian file bytes in place");

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16, slice::HalfBitsSliceExt, slice::HalfFloatSliceExt};
use memmap2::Mmap;

use crate::tensor::finite::{first_non_finite, first_non_finite_bf16, first_non_finite_f16};
use crate::tensor::DType;
use crate::{bail_model, Result};

/// A borrowed tensor: its bytes live in a mapped weight file.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    /// The file the tensor was read from (for error messages).
    pub file: &'a Path,
    pub dtype: DType,
    pub shape: &'a [usize],
    /// Exactly `numel() * dtype.size_in_bytes()` bytes.
    pub bytes: &'a [u8],
}

/// Leaves out the bytes, which may be gigabytes.
impl fmt::Debug for TensorView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorView")
            .field("name", &self.name)
            .field("file", &self.file)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("byte_len", &self.bytes.len())
            .finish()
    }
}

impl<'a> TensorView<'a> {
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.dtype.size_in_bytes()
    }

    /// The values as f32: borrowed from the file for 4-byte aligned F32 data,
    /// copied when misaligned, converted for F16 and BF16.
    pub fn to_f32(&self) -> Result<Cow<'a, [f32]>> {
        match self.dtype {
            DType::F32 => Ok(cast_or_copy::<f32>(self.bytes)),
            DType::F16 | DType::BF16 => Ok(Cow::Owned(widen(self.dtype, &self.as_u16()?))),
            DType::I8 | DType::I32 | DType::F8E4M3 => self.wrong_dtype("F32, F16 or BF16"),
        }
    }

    /// Raw bits of F16 or BF16 data; zero-copy when 2-byte aligned.
    pub fn as_u16(&self) -> Result<Cow<'a, [u16]>> {
        match self.dtype {
            DType::F16 | DType::BF16 => Ok(cast_or_copy::<u16>(self.bytes)),
            _ => self.wrong_dtype("F16 or BF16"),
        }
    }

    /// I8 data; always zero-copy.
    pub fn as_i8(&self) -> Result<Cow<'a, [i8]>> {
        match self.dtype {
            DType::I8 => Ok(cast_or_copy::<i8>(self.bytes)),
            _ => self.wrong_dtype("I8"),
        }
    }

    /// F8_E4M3 codes (decoded with their scales by the FP8 method); always
    /// zero-copy.
    pub fn as_e4m3(&self) -> Result<&'a [u8]> {
        match self.dtype {
            DType::F8E4M3 => Ok(self.bytes),
            _ => self.wrong_dtype("F8_E4M3"),
        }
    }

    /// I32 data; zero-copy when 4-byte aligned.
    pub fn as_i32(&self) -> Result<Cow<'a, [i32]>> {
        match self.dtype {
            DType::I32 => Ok(cast_or_copy::<i32>(self.bytes)),
            _ => self.wrong_dtype("I32"),
        }
    }

    /// Refuses float data holding a NaN or infinity: such a weight makes
    /// every logit NaN. Integer data passes.
    pub fn check_finite(&self) -> Result<()> {
        let bad = match self.dtype {
            DType::F32 => first_non_finite(&self.to_f32()?),
            DType::BF16 => first_non_finite_bf16(&self.as_u16()?),
            DType::F16 => first_non_finite_f16(&self.as_u16()?),
            DType::F8E4M3 => self.bytes.iter().position(|&b| b & 0x7f == 0x7f),
            DType::I8 | DType::I32 => None,
        };
        match bad {
            None => Ok(()),
            Some(i) => bail_model!(
                "{}: tensor '{}' holds a non-finite value ({}) at element {i}",
                self.file.display(),
                self.name,
                match self.dtype {
                    DType::F8E4M3 => f32::NAN,
                    _ => self.to_f32()?[i],
                }
            ),
        }
    }

    fn wrong_dtype<T>(&self, wanted: &str) -> Result<T> {
        bail_model!(
            "{}: tensor '{}' has dtype {}, expected {wanted}",
            self.file.display(),
            self.name,
            self.dtype.safetensors_tag()
        )
    }
}

/// A tensor that keeps its weight file mapped for as long as it lives, so it
/// can outlive the [`WeightFiles`](super::safetensors::WeightFiles) it came from.
#[derive(Debug, Clone)]
pub struct MappedTensor {
    pub(crate) name: String,
    pub(crate) file: PathBuf,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) map: Arc<Mmap>,
    /// Absolute byte range in the file, validated against its length.
    pub(crate) start: usize,
    pub(crate) end: usize,
}

impl MappedTensor {
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            name: &self.name,
            file: &self.file,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.map[self.start..self.end],
        }
    }
}

/// Element types for which every bit pattern is a valid value.
///
/// # Safety
/// Implementors must be plain integers or floats: no padding, no invalid
/// bit patterns, alignment no larger than their size.
unsafe trait Plain: Copy {
    fn from_le(bytes: &[u8]) -> Self;
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        // SAFETY: primitive number types satisfy the trait contract.
        unsafe impl Plain for $t {
            fn from_le(bytes: &[u8]) -> Self {
                let mut raw = [0u8; std::mem::size_of::<$t>()];
                raw.copy_from_slice(bytes);
                <$t>::from_le_bytes(raw)
            }
        }
    )*};
}
plain!(f32, u16, i8, i32);

/// Reinterprets `bytes` in place when aligned and a whole number of
/// elements; otherwise decodes a copy (any remainder bytes are dropped,
/// which the header validation makes impossible).
fn cast_or_copy<T: Plain>(bytes: &[u8]) -> Cow<'_, [T]> {
    let size = std::mem::size_of::<T>();
    if bytes.as_ptr().cast::<T>().is_aligned() && bytes.len().is_multiple_of(size) {
        // SAFETY: the pointer is aligned for T and covers len / size whole
        // elements inside `bytes`; T accepts any bit pattern (`Plain`) and the
        // host is little-endian like the file; the result borrows `bytes`.
        let typed =
            unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) };
        Cow::Borrowed(typed)
    } else {
        Cow::Owned(bytes.chunks_exact(size).map(T::from_le).collect())
    }
}

/// Converts raw F16 or BF16 bits to f32 (SIMD where `half` has it).
fn widen(dtype: DType, bits: &[u16]) -> Vec<f32> {
    let mut out = vec![0f32; bits.len()];
    if dtype == DType::BF16 {
        bits.reinterpret_cast::<bf16>()
            .convert_to_f32_slice(&mut out);
    } else {
        bits.reinterpret_cast::<f16>()
            .convert_to_f32_slice(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(dtype: DType, shape: &'a [usize], bytes: &'a [u8]) -> TensorView<'a> {
        TensorView {
            name: "t",
            file: Path::new("f.safetensors"),
            dtype,
            shape,
            bytes,
        }
    }

    /// A buffer whose start is 8-aligned, so sub-slices have known alignment.
    #[repr(C, align(8))]
    struct Aligned([u8; 64]);

    /// `data` placed at offset `pad` of an aligned buffer.
    fn placed(pad: usize, data: &[u8]) -> Aligned {
        let mut buf = Aligned([0; 64]);
        buf.0[pad..pad + data.len()].copy_from_slice(data);
        buf
    }

    #[test]
    fn f32_borrowed_when_aligned_copied_when_not() {
        let values = [1.5f32, -2.0, 3.25];
        let le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buf = placed(4, &le);
        let aligned = view(DType::F32, &[3], &buf.0[4..16]);
        assert!(matches!(aligned.to_f32().unwrap(), Cow::Borrowed(v) if v == values));

        let buf = placed(1, &le);
        let misaligned = view(DType::F32, &[3], &buf.0[1..13]);
        assert!(matches!(misaligned.to_f32().unwrap(), Cow::Owned(v) if v == values));
        assert_eq!(misaligned.numel(), 3);
        assert_eq!(
            format!("{misaligned:?}"),
            r#"TensorView { name: "t", file: "f.safetensors", dtype: F32, shape: [3], byte_len: 12 }"#
        );
    }

    #[test]
    fn half_types_widen_and_expose_bits() {
        let vals = [0.5f32, -1.0, 65504.0, 0.0];
        let f16_bytes: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        let bf16_bytes: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(
            view(DType::F16, &[4], &f16_bytes)
                .to_f32()
                .unwrap()
                .as_ref(),
            vals
        );
        let bf = view(DType::BF16, &[4], &bf16_bytes).to_f32().unwrap();
        assert_eq!(bf[0], 0.5);
        assert_eq!(bf[2], bf16::from_f32(65504.0).to_f32());
        let buf = placed(2, &bf16_bytes);
        let bits = view(DType::BF16, &[4], &buf.0[2..10]).as_u16().unwrap();
        assert!(matches!(&bits, Cow::Borrowed(_)));
        assert_eq!(bits[1], bf16::from_f32(-1.0).to_bits());
        // Misaligned half data is copied, values unchanged.
        let buf = placed(1, &f16_bytes);
        let v = view(DType::F16, &[4], &buf.0[1..9]);
        assert!(matches!(v.as_u16().unwrap(), Cow::Owned(_)));
        assert_eq!(v.to_f32().unwrap().as_ref(), vals);
    }

    #[test]
    fn integer_views_and_dtype_errors() {
        let i8s = [0x80u8, 0x7f, 0x01];
        assert!(
            matches!(view(DType::I8, &[3], &i8s).as_i8().unwrap(), Cow::Borrowed(v) if v == [-128, 127, 1])
        );
        let i32s: Vec<u8> = [-7i32, 1 << 30]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            view(DType::I32, &[2], &i32s).as_i32().unwrap().as_ref(),
            [-7, 1 << 30]
        );

        let e = view(DType::I8, &[3], &i8s).to_f32().unwrap_err();
        assert_eq!(
            e.message,
            "f.safetensors: tensor 't' has dtype I8, expected F32, F16 or BF16"
        );
        let e = view(DType::F32, &[0], &[]).as_u16().unwrap_err();
        assert!(
            e.message.contains("has dtype F32, expected F16 or BF16"),
            "{}",
            e.message
        );
        assert!(view(DType::F32, &[0], &[]).as_i32().is_err());
        assert!(view(DType::I32, &[0], &[]).as_i8().is_err());
        assert!(view(DType::F32, &[0], &[]).to_f32().unwrap().is_empty());
    }
}
