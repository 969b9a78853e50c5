//! Physical KV storage: per layer, keys and values as `[num_slots, kv_heads, head_dim]` f32.
//! Slot 0 is reserved (the paged backend's null block starts there, the token
//! backend's dummy slot is slot 0), so managers never hand it out.

use crate::backend::LayerKv;
use crate::memory::zeroed_f32;
use crate::{Error, ErrorKind, Result};

pub struct KvStorage {
    pub num_layers: usize,
    pub num_slots: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvStorage {
    /// Zeroed storage. Its size comes from the caller's KV budget, so the
    /// allocation is fallible: too large is `OutOfMemory`, not an abort.
    pub fn new(
        num_layers: usize,
        num_slots: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let per_layer = num_slots
            .checked_mul(kv_heads)
            .and_then(|n| n.checked_mul(head_dim))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    format!("a KV cache of {num_slots} slots overflows the address space"),
                )
            })?;
        let layer = || zeroed_f32(per_layer, "the KV cache");
        Ok(KvStorage {
            num_layers,
            num_slots,
            kv_heads,
            head_dim,
            keys: (0..num_layers).map(|_| layer()).collect::<Result<_>>()?,
            values: (0..num_layers).map(|_| layer()).collect::<Result<_>>()?,
        })
    }

    /// Floats in one slot of one layer (kv_heads * head_dim).
    #[inline]
    pub fn slot_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of KV data held per slot across all layers (keys and values).
    pub fn bytes_per_slot(num_layers: usize, kv_heads: usize, head_dim: usize) -> usize {
        2 * num_layers * kv_heads * head_dim * std::mem::size_of::<f32>()
    }

    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    pub fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.keys[layer], &mut self.values[layer])
    }

    /// Copies one slot (all layers) into `out` (keys then values per layer): used by swap-out.
    pub fn read_slot(&self, slot: usize, out: &mut Vec<f32>) {
        let w = self.slot_width();
        for l in 0..self.num_layers {
            out.extend_from_slice(&self.keys[l][slot * w..(slot + 1) * w]);
            out.extend_from_slice(&self.values[l][slot * w..(slot + 1) * w]);
        }
    }

    /// Inverse of `read_slot`; returns the number of floats consumed.
    pub fn write_slot(&mut self, slot: usize, data: &[f32]) -> usize {
        let w = self.slot_width();
        let mut off = 0;
        for l in 0..self.num_layers {
            self.keys[l][slot * w..(slot + 1) * w].copy_from_slice(&data[off..off + w]);
            off += w;
            self.values[l][slot * w..(slot + 1) * w].copy_from_slice(&data[off..off + w]);
            off += w;
        }
        off
    }
}

impl LayerKv for KvStorage {
    fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        KvStorage::layer_mut(self, layer)
    }
}
