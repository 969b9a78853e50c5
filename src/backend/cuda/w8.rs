//! FP8 (E4M3) weights on the device: the codes `[rows, cols]` as stored and
//! one f32 scale per row and group of columns ([`Fp8Rows`]). Decode-sized
//! batches multiply them in the `*_f8` GEMV kernels of `kernels/decoder.cu`
//! (16 codes per lane load, each chunk's sum times its scale); larger
//! batches dequantize to the activation dtype for cuBLAS (`fp8_dequant`).

use super::{CudaDevice, DeviceBuffer, KArg, Staging};
use crate::tensor::fp8::Fp8Rows;
use crate::{bail_model, Result};

/// Columns per lane chunk of the FP8 GEMV: inputs and scale groups must be
/// whole chunks.
pub const W8_CHUNK: usize = 16;

/// An FP8 matrix on the device.
pub struct W8Matrix {
    pub rows: usize,
    pub cols: usize,
    group_cols: usize,
    codes: DeviceBuffer<u8>,
    /// `[rows, groups]`.
    scales: DeviceBuffer<f32>,
}

/// Why `m` cannot take the CUDA FP8 path, if it cannot.
fn unsupported_reason(m: &Fp8Rows) -> Option<String> {
    let chunks = m.group_cols / W8_CHUNK;
    let whole_rows = m.group_cols >= m.cols;
    if !m.cols.is_multiple_of(W8_CHUNK)
        || !(whole_rows || (m.group_cols.is_multiple_of(W8_CHUNK) && chunks.is_power_of_two()))
    {
        return Some(format!(
            "fp8 matrix [{}, {}] with scale groups of {} columns: CUDA needs inputs a multiple \
             of {W8_CHUNK} and groups of {W8_CHUNK} times a power of two columns (or one per row)",
            m.rows, m.cols, m.group_cols
        ));
    }
    None
}

/// log2 of the GEMV's 16-column chunks per scale group (a shift that
/// leaves every chunk in group 0 when one group spans the row).
fn group_shift(group_cols: usize, cols: usize) -> i32 {
    if group_cols >= cols {
        30
    } else {
        (group_cols / W8_CHUNK).trailing_zeros() as i32
    }
}

impl W8Matrix {
    /// Uploads parts stacked row-wise (concatenation: scales are per row);
    /// all parts share `cols` and their column groups.
    pub fn upload(
        dev: &CudaDevice,
        parts: &[Fp8Rows],
        mut staging: Option<&mut Staging>,
    ) -> Result<W8Matrix> {
        let first = &parts[0];
        for p in parts {
            if let Some(why) = unsupported_reason(p) {
                bail_model!("{why}");
            }
            if p.cols != first.cols || p.group_cols != first.group_cols {
                bail_model!(
                    "fp8 matrices stacked for one projection differ: [{}, {}] in groups of {} and \
                     [{}, {}] in groups of {}",
                    first.rows,
                    first.cols,
                    first.group_cols,
                    p.rows,
                    p.cols,
                    p.group_cols
                );
            }
        }
        let n_codes: usize = parts.iter().map(|p| p.codes.len()).sum();
        let n_scales: usize = parts.iter().map(|p| p.scales.len()).sum();
        let mut codes = dev.alloc::<u8>(n_codes)?;
        let mut scales = dev.alloc::<f32>(n_scales)?;
        let (mut co, mut so) = (0, 0);
        for p in parts {
            dev.upload_with(staging.as_deref_mut(), &p.codes, &mut codes, co)?;
            dev.upload_with(staging.as_deref_mut(), &p.scales, &mut scales, so)?;
            co += p.codes.len();
            so += p.scales.len();
        }
        Ok(W8Matrix {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            group_cols: first.group_cols,
            codes,
            scales,
        })
    }

    pub fn bytes(&self) -> usize {
        self.codes.bytes() + self.scales.bytes()
    }

    pub fn codes_ptr(&self) -> u64 {
        self.codes.ptr()
    }

    fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_cols)
    }

    /// The arguments the `*_f8` GEMV kernels take after their 16-bit
    /// twins' (`GEMV_W8_PARAMS`): the scales, groups per row, log2 of the
    /// chunks per group.
    pub fn gemv_args(&self) -> [KArg; 3] {
        [
            KArg::Ptr(self.scales.ptr()),
            KArg::I32(self.groups() as i32),
            KArg::I32(group_shift(self.group_cols, self.cols)),
        ]
    }
}

impl CudaDevice {
    /// `out[rows, cols]` (activation dtype) = the values of `m`.
    pub fn w8_dequant(&self, m: &W8Matrix, out: u64) -> Result<()> {
        let runs = m.rows * m.cols / 8;
        self.launch(
            &self.kernels.fp8_dequant,
            (runs.div_ceil(256) as u32, 1, 1),
            256,
            &[
                KArg::Ptr(m.codes.ptr()),
                KArg::Ptr(m.scales.ptr()),
                KArg::I32(m.rows as i32),
                KArg::I32(m.cols as i32),
                KArg::I32(m.groups() as i32),
                KArg::I32(m.group_cols as i32),
                KArg::Ptr(out),
            ],
        )
    }
}
