//! Swapping a session's KV slots to host memory and back (preemption by
//! swap), through a device staging buffer, layer by layer.

use super::CudaForward;
use crate::backend::cuda::KArg;
use crate::forward::{e4m3_from_f32, e4m3_to_f32};
use crate::{bail_arg, Error, ErrorKind, Result};

impl CudaForward {
    /// in the cache's 16-bit words (two values each in an fp8 cache).
    fn copy_slots(&mut self, slots: &[u32], host: &mut [u16], to_host: bool) -> Result<()> {
        let c = &self.model.dims;
        let (n, w, layers) = (slots.len(), self.kv_row_words(), c.layers);
        let dev = self.model.dev.clone();
        if self
            .staging
            .as_ref()
            .is_none_or(|s| s.len() < n * 2 * w + n)
        {
            self.staging = Some(dev.alloc::<u16>((n * 2 * w + n).next_power_of_two())?);
        }
        let mut idx = dev.alloc::<u32>(n)?;
        dev.upload(slots, &mut idx)?;
        let mut staged = vec![0u16; n * 2 * w];
        let _turn = dev.step_lock.lock().unwrap_or_else(|p| p.into_inner());
        for l in 0..layers {
            if !to_host {
                for (s, chunk) in staged.chunks_mut(2 * w).enumerate() {
                    chunk.copy_from_slice(
                        &host[(s * layers + l) * 2 * w..(s * layers + l + 1) * 2 * w],
                    );
                }
                dev.upload(&staged, self.staging.as_mut().expect("allocated above"))?;
            }
            let (kc, vc) = self.layer_kv(l);
            let staging = self.staging.as_ref().expect("allocated above");
            dev.launch(
                &dev.kernels.kv_copy_slots,
                (n as u32, 1, 1),
                128,
                &[
                    KArg::Ptr(kc),
                    KArg::Ptr(vc),
                    KArg::Ptr(idx.ptr()),
                    KArg::Ptr(staging.ptr()),
                    KArg::I32(w as i32),
                    KArg::I32(to_host as i32),
                ],
            )?;
            if to_host {
                dev.download(staging, &mut staged)?;
                for (s, chunk) in staged.chunks(2 * w).enumerate() {
                    host[(s * layers + l) * 2 * w..(s * layers + l + 1) * 2 * w]
                        .copy_from_slice(chunk);
                }
            }
        }
        dev.synchronize()
    }

    /// The values of the cache's words (`copy_slots`' layout).
    fn decode_kv_words(&self, words: &[u16], out: &mut Vec<f32>) {
        if self.kv_fp8() {
            out.extend(words.iter().flat_map(|w| w.to_le_bytes()).map(e4m3_to_f32));
        } else {
            let act = self.model.dev.act;
            out.extend(words.iter().map(|&b| act.decode(b)));
        }
    }

    /// The cache's words of `values` (exact for values read by `decode_kv_words`).
    fn encode_kv_words(&self, values: &[f32]) -> Vec<u16> {
        if self.kv_fp8() {
            values
                .chunks(2)
                .map(|p| u16::from_le_bytes([e4m3_from_f32(p[0]), e4m3_from_f32(p[1])]))
                .collect()
        } else {
            self.model.dev.act.encode(values)
        }
    }

    pub fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()> {
        let n = slots.len() * self.kv_values_per_slot();
        // A host that cannot hold the swapped KV gets an error (the engine
        // recomputes instead), not an abort.
        let no_memory = |_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("no host memory for {n} swapped KV values"),
            )
        };
        let words = slots.len() * 2 * self.model.dims.layers * self.kv_row_words();
        let mut bits = Vec::new();
        bits.try_reserve_exact(words).map_err(no_memory)?;
        bits.resize(words, 0u16);
        out.try_reserve(n).map_err(no_memory)?;
        self.copy_slots(slots, &mut bits, true)?;
        self.decode_kv_words(&bits, out);
        Ok(())
    }

    pub fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        if data.len() != slots.len() * self.kv_values_per_slot() {
            bail_arg!(
                "restore_kv: {} values for {} slots",
                data.len(),
                slots.len()
            );
        }
        let mut bits = self.encode_kv_words(data);
        self.copy_slots(slots, &mut bits, false)
    }
}
