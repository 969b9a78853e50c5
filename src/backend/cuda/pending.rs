//! Token ids copied back to the host without waiting for them: a step's
//! argmax ids land in pinned host memory while the step after it is already
//! queued on the stream, so the GPU does not idle while the host reports
//! the earlier step.

use super::{cuda_error, CudaDevice, DeviceBuffer};
use crate::{Error, ErrorKind, Result};
use cudarc::driver::{CudaEvent, PinnedHostSlice};
use std::collections::VecDeque;

/// Copies of ids in flight, at most one per buffer.
pub struct PendingIds {
    bufs: [PinnedHostSlice<u32>; 2],
    /// Oldest first: (buffer, ids copied, the copy's completion).
    queue: VecDeque<(usize, usize, CudaEvent)>,
    /// The buffer the next copy goes to.
    next: usize,
}

impl Drop for PendingIds {
    fn drop(&mut self) {
        // The buffers are freed after this: wait for the copies into them.
        for (_, _, done) in &self.queue {
            let _ = done.synchronize();
        }
    }
}

impl CudaDevice {
    /// Two pinned buffers of `capacity` ids each (plain, cached memory: the
    /// host reads them).
    pub fn pending_ids(&self, capacity: usize) -> Result<PendingIds> {
        // SAFETY: a buffer is read only after a copy into it has completed.
        let alloc = || unsafe { self.ctx.alloc_pinned_with_flags::<u32>(capacity.max(1), 0) };
        let alloc = || alloc().map_err(|e| cuda_error("allocating pinned host memory", e));
        Ok(PendingIds {
            bufs: [alloc()?, alloc()?],
            queue: VecDeque::with_capacity(2),
            next: 0,
        })
    }

    /// Queues a copy of the first `n` elements of `src` into `pending`;
    /// `PendingIds::wait_oldest` hands them out.
    pub fn download_later(
        &self,
        src: &DeviceBuffer<u32>,
        n: usize,
        pending: &mut PendingIds,
    ) -> Result<()> {
        let i = pending.next;
        if pending.queue.len() == pending.bufs.len() || n > pending.bufs[i].len() {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "a deferred copy of {n} ids with {} copies in flight (room: {} ids in each of {} buffers)",
                    pending.queue.len(),
                    pending.bufs[i].len(),
                    pending.bufs.len()
                ),
            ));
        }
        self.prepare_copy("download", n, src.len(), 0)?;
        let buf = pending.bufs[i]
            .as_mut_slice()
            .map_err(|e| cuda_error("pinned host buffer", e))?;
        // SAFETY: `buf[..n]` is pinned host memory that `src` covers (checked
        // above); nothing reads or frees it before `done` has completed
        // (`wait_oldest`, `Drop`).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut buf[..n],
                src.at(0),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| cuda_error("device-to-host copy", e))?;
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_error("recording a deferred copy", e))?;
        pending.queue.push_back((i, n, done));
        pending.next ^= 1;
        Ok(())
    }

    /// Copies `n` elements of `src` from `src_at` on into `dst` from
    /// `dst_at` on, ordered on the stream.
    pub fn copy_on_device<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &DeviceBuffer<T>,
        src_at: usize,
        dst: &mut DeviceBuffer<T>,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        self.prepare_copy("device copy (source)", n, src.len(), src_at)?;
        if !self.prepare_copy("device copy (destination)", n, dst.len(), dst_at)? {
            return Ok(());
        }
        let bytes = n * std::mem::size_of::<T>();
        // SAFETY: both ranges lie inside their live buffers (checked above).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.at(dst_at),
                src.at(src_at),
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| cuda_error("device-to-device copy", e))
    }
}

impl PendingIds {
    /// Whether no copy is in flight.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Waits for the oldest copy and writes its first ids to `out` (as many
    /// as both hold).
    pub fn wait_oldest(&mut self, out: &mut [u32]) -> Result<()> {
        let Some((i, n, done)) = self.queue.pop_front() else {
            return Err(Error::new(
                ErrorKind::Internal,
                "waiting for deferred ids, but none were queued",
            ));
        };
        done.synchronize()
            .map_err(|e| cuda_error("waiting for a deferred copy", e))?;
        let ids = self.bufs[i]
            .as_slice()
            .map_err(|e| cuda_error("pinned host buffer", e))?;
        let m = n.min(out.len());
        out[..m].copy_from_slice(&ids[..m]);
        Ok(())
    }
}
