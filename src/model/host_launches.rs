//! Launch and collect (`ForwardContext::launch` / `collect_ids`) for a
//! context whose device runs each forward at once (the CPU). The engine's
//! overlapped-step schedule then runs unchanged on it, which is how that
//! schedule is tested without a GPU: each launch computes its ids at once
//! and queues them for `collect_ids`. A device with a queue of its own (a
//! GPU) implements launch itself and is never wrapped.

use super::runner::{ForwardContext, NON_FINITE_ROW};
use crate::forward::ForwardBatch;
use crate::memory::WorkspaceStats;
use crate::sampling::{DeviceSampling, MaskFill};
use crate::{bail_arg, Error, Result};
use std::collections::VecDeque;

/// A context with launches computed at once, oldest first in the queue.
pub struct HostLaunches {
    inner: Box<dyn ForwardContext>,
    queue: VecDeque<Vec<u32>>,
    /// The newest queued ids are the last forward's (a chained launch reads
    /// them as its tokens).
    chainable: bool,
    /// Chained tokens and spent id buffers, reused.
    tokens: Vec<u32>,
    spare: Vec<Vec<u32>>,
}

impl HostLaunches {
    /// `inner` with launches; a context that launches itself is returned as is.
    pub fn wrap(inner: Box<dyn ForwardContext>) -> Box<dyn ForwardContext> {
        if inner.overlaps_steps() {
            return inner;
        }
        Box::new(HostLaunches {
            inner,
            queue: VecDeque::with_capacity(2),
            chainable: false,
            tokens: Vec::new(),
            spare: Vec::new(),
        })
    }
}

impl ForwardContext for HostLaunches {
    fn forward(&mut self, batch: &ForwardBatch<'_>, logits: &mut [f32]) -> Result<()> {
        self.chainable = false;
        self.inner.forward(batch, logits)
    }
    fn forward_argmax(&mut self, batch: &ForwardBatch<'_>, ids: &mut [u32]) -> Result<()> {
        self.chainable = false;
        self.inner.forward_argmax(batch, ids)
    }
    fn launch(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: Option<&DeviceSampling>,
        chained: bool,
    ) -> Result<()> {
        if sampling.is_some() {
            return Err(Error::unsupported("this device samples on the host"));
        }
        if self.queue.len() >= 2 {
            bail_arg!("launch with two launches outstanding");
        }
        let fed;
        let batch = if chained {
            let rows = batch.tokens.len();
            let prev = self.queue.back();
            let Some(prev) = prev.filter(|p| self.chainable && p.len() >= rows) else {
                bail_arg!("a chained launch of {rows} rows does not follow a launch of as many");
            };
            self.tokens.clear();
            // A non-finite row's request is ended when its ids land; its
            // chained row only needs a valid placeholder meanwhile.
            let placeholder = |&t: &u32| if t == NON_FINITE_ROW { 0 } else { t };
            self.tokens.extend(prev[..rows].iter().map(placeholder));
            fed = ForwardBatch {
                tokens: &self.tokens,
                ..*batch
            };
            &fed
        } else {
            batch
        };
        let mut ids = self.spare.pop().unwrap_or_default();
        ids.clear();
        ids.resize(batch.logits_rows.len(), 0);
        let result = self.inner.forward_argmax(batch, &mut ids);
        self.chainable = result.is_ok();
        match result {
            Ok(()) => self.queue.push_back(ids),
            Err(_) => self.spare.push(ids),
        }
        result
    }
    fn collect_ids(&mut self, ids: &mut [u32]) -> Result<()> {
        let Some(done) = self.queue.pop_front() else {
            bail_arg!("collect_ids without a launch");
        };
        let n = done.len().min(ids.len());
        ids[..n].copy_from_slice(&done[..n]);
        self.spare.push(done);
        Ok(())
    }
    fn samples_on_device(&self) -> bool {
        self.inner.samples_on_device()
    }
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch<'_>,
        sampling: &DeviceSampling,
        masks: &mut MaskFill<'_>,
        ids: &mut [u32],
        logits: &mut [f32],
    ) -> Result<()> {
        self.chainable = false;
        self.inner
            .forward_sample(batch, sampling, masks, ids, logits)
    }
    fn kv_values_per_slot(&self) -> usize {
        self.inner.kv_values_per_slot()
    }
    fn save_kv(&mut self, slots: &[u32], out: &mut Vec<f32>) -> Result<()> {
        self.inner.save_kv(slots, out)
    }
    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        self.inner.restore_kv(slots, data)
    }
    fn workspace_stats(&self) -> Option<WorkspaceStats> {
        self.inner.workspace_stats()
    }
}
