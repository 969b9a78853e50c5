//! Decoder weights from safetensors files: zero-copy views into the mmap when
//! the stored dtype is the one computed with, converted copies otherwise;
//! int8 tensors through the checkpoint's quantization method.

use super::quant::{method_from_metadata, QuantMethod};
use super::safetensors::{TensorView, WeightFiles};
use super::weights::{WeightDType, WeightSource};
use crate::backend::cpu::elem::{Bf16, F16};
use crate::backend::cpu::{Matrix, MatrixData};
use crate::tensor::{DType, HostSlice};
use crate::{Error, Result};
use std::any::Any;
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// Opens `model.safetensors` or a sharded index in `dir`.
pub fn open_weights(dir: &Path) -> Result<WeightFiles> {
    WeightFiles::open(dir)
}

impl WeightSource for WeightFiles {
    fn contains(&self, name: &str) -> bool {
        WeightFiles::contains(self, name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: WeightDType) -> Result<Matrix> {
        let view = self.require(name, &[rows, cols])?;
        if view.dtype == DType::I8 {
            return match method_from_metadata(self.metadata())? {
                Some(method) => method.load(self, name, rows, cols),
                None => Err(Error::invalid_model(format!(
                    "{}: tensor `{name}` is I8 but the checkpoint's metadata names no quantization (expected {{\"quantization\": \"q8_0\", \"group_size\": ..}})",
                    view.file.display()
                ))),
            };
        }
        if view.dtype == DType::F8E4M3 {
            return Err(Error::invalid_model(format!(
                "{}: tensor `{name}` is F8_E4M3 but config.json names no fp8 quantization_config (its scales would be ignored)",
                view.file.display()
            )));
        }
        let owner = self.owner_of(name);
        let target = match dtype {
            WeightDType::Auto => view.dtype,
            WeightDType::F32 => DType::F32,
            WeightDType::F16 => DType::F16,
            WeightDType::BF16 => DType::BF16,
        };
        let data = match (view.dtype, target) {
            (DType::F32, DType::F32) => MatrixData::F32(slice_of(owner, view.to_f32()?)),
            (DType::BF16, DType::BF16) => {
                MatrixData::BF16(slice_of(owner, retag(view.as_u16()?, Bf16)))
            }
            (DType::F16, DType::F16) => {
                MatrixData::F16(slice_of(owner, retag(view.as_u16()?, F16)))
            }
            (_, DType::F32) => MatrixData::F32(HostSlice::from_vec(view.to_f32()?.into_owned())),
            (_, DType::BF16) => MatrixData::BF16(HostSlice::from_vec(
                view.to_f32()?
                    .iter()
                    .map(|&v| Bf16(half::bf16::from_f32(v).to_bits()))
                    .collect(),
            )),
            (_, DType::F16) => MatrixData::F16(HostSlice::from_vec(
                view.to_f32()?
                    .iter()
                    .map(|&v| F16(half::f16::from_f32(v).to_bits()))
                    .collect(),
            )),
            (stored, _) => return Err(unsupported_dtype(&view, stored)),
        };
        Ok(Matrix { rows, cols, data })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let view = self.require(name, &[len])?;
        Ok(view.to_f32()?.into_owned())
    }

    fn quantized(
        &self,
        method: &dyn QuantMethod,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Matrix>> {
        if method.stored_in(self, name) {
            method.load(self, name, rows, cols).map(Some)
        } else {
            Ok(None)
        }
    }
    fn stores_quantized(&self, method: &dyn QuantMethod, name: &str) -> bool {
        method.stored_in(self, name)
    }
}

impl WeightFiles {
    /// The mmap holding `name`, as a keep-alive owner for zero-copy slices.
    fn owner_of(&self, name: &str) -> Option<Arc<dyn Any + Send + Sync>> {
        self.get_mapped(name)
            .map(|m| m.map as Arc<dyn Any + Send + Sync>)
    }
}

fn unsupported_dtype(view: &TensorView<'_>, stored: DType) -> Error {
    Error::unsupported(format!(
        "{}: tensor `{}` has dtype {stored}, which cannot be used as a weight matrix",
        view.file.display(),
        view.name
    ))
}

/// Reinterprets raw 16-bit words as a weight element type.
fn retag<T: Copy + 'static>(words: Cow<'_, [u16]>, wrap: fn(u16) -> T) -> Cow<'_, [T]>
where
    [T]: ToOwned<Owned = Vec<T>>,
{
    match words {
        Cow::Borrowed(w) => {
            debug_assert_eq!(std::mem::size_of::<T>(), 2);
            // SAFETY: T is a #[repr(transparent)] wrapper of u16 (Bf16/F16), so
            // the layout and alignment are identical.
            Cow::Borrowed(unsafe { std::slice::from_raw_parts(w.as_ptr() as *const T, w.len()) })
        }
        Cow::Owned(v) => Cow::Owned(v.into_iter().map(wrap).collect()),
    }
}

/// Zero-copy when `data` borrows from the mmap kept alive by `owner`.
fn slice_of<T: Copy + Send + Sync + 'static>(
    owner: Option<Arc<dyn Any + Send + Sync>>,
    data: Cow<'_, [T]>,
) -> HostSlice<T>
where
    [T]: ToOwned<Owned = Vec<T>>,
{
    match (data, owner) {
        // SAFETY: the slice points into the read-only mmap that `owner` keeps alive.
        (Cow::Borrowed(s), Some(owner)) => unsafe { HostSlice::borrowed_from(owner, s) },
        (data, _) => HostSlice::from_vec(data.into_owned()),
    }
}
