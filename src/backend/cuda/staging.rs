//! Host-to-device uploads of weights through pinned staging buffers: host
//! threads fill one buffer while the copy engine drains the other, so the
//! transfer runs at DMA speed instead of the driver's pageable-copy path.

use super::{cuda_error, CudaDevice, DeviceBuffer};
use crate::Result;
use cudarc::driver::{CudaEvent, DeviceRepr, PinnedHostSlice};

/// Bytes per staging buffer (two are used in turn).
const STAGE_BYTES: usize = 64 << 20;
/// Host threads copying into a staging buffer (page-cache reads into
/// write-combined memory; one thread does not keep the copy engine busy).
const FILL_THREADS: usize = 4;

/// Two pinned buffers and the copy each last fed.
pub struct Staging {
    bufs: [PinnedHostSlice<u8>; 2],
    /// Completion of the device copy out of each buffer.
    done: [Option<CudaEvent>; 2],
    next: usize,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The buffers are freed after this: wait for the copies out of them.
        for e in self.done.iter().flatten() {
            let _ = e.synchronize();
        }
    }
}

impl CudaDevice {
    /// Pinned staging buffers for [`CudaDevice::upload_staged`]; `None`
    /// where page-locked memory cannot be had (plain copies then).
    pub fn staging(&self) -> Option<Staging> {
        // SAFETY: the buffers are written before any copy reads them.
        let alloc = || unsafe { self.ctx.alloc_pinned::<u8>(STAGE_BYTES) };
        let (a, b) = (alloc().ok()?, alloc().ok()?);
        Some(Staging {
            bufs: [a, b],
            done: [None, None],
            next: 0,
        })
    }

    /// Copies `host` into `dst` from element `offset` on, through the
    /// staging buffers when there are some, else with a plain copy.
    pub fn upload_with<T: DeviceRepr>(
        &self,
        staging: Option<&mut Staging>,
        host: &[T],
        dst: &mut DeviceBuffer<T>,
        offset: usize,
    ) -> Result<()> {
        match staging {
            Some(st) => self.upload_staged(st, host, dst, offset),
            None => self.upload_at(host, dst, offset),
        }
    }

    /// Copies `host` into `dst` from element `offset` on, through `st`
    /// (asynchronous: the stream orders it before later work).
    pub fn upload_staged<T: DeviceRepr>(
        &self,
        st: &mut Staging,
        host: &[T],
        dst: &mut DeviceBuffer<T>,
        offset: usize,
    ) -> Result<()> {
        self.prepare_copy("upload", host.len(), dst.len(), offset)?;
        // SAFETY: `T: DeviceRepr` values are plain data; the byte view
        // covers exactly `host`'s memory.
        let bytes = unsafe {
            std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), std::mem::size_of_val(host))
        };
        let mut at = dst.at(offset);
        for chunk in bytes.chunks(STAGE_BYTES) {
            let i = st.next;
            st.next ^= 1;
            if let Some(e) = st.done[i].take() {
                e.synchronize()
                    .map_err(|e| cuda_error("waiting for a staged copy", e))?;
            }
            let buf = st.bufs[i]
                .as_mut_slice()
                .map_err(|e| cuda_error("staging buffer", e))?;
            let buf = &mut buf[..chunk.len()];
            let part = chunk.len().div_ceil(FILL_THREADS).max(1);
            std::thread::scope(|s| {
                for (d, c) in buf.chunks_mut(part).zip(chunk.chunks(part)) {
                    s.spawn(move || d.copy_from_slice(c));
                }
            });
            self.ctx
                .bind_to_thread()
                .map_err(|e| cuda_error("binding the context", e))?;
            // SAFETY: `at .. at + len` lies inside `dst` (checked above);
            // the pinned source stays untouched until `done[i]` completes.
            unsafe { cudarc::driver::result::memcpy_htod_async(at, buf, self.stream.cu_stream()) }
                .map_err(|e| cuda_error("staged host-to-device copy", e))?;
            st.done[i] = Some(
                self.stream
                    .record_event(None)
                    .map_err(|e| cuda_error("recording a staged copy", e))?,
            );
            at += chunk.len() as u64;
        }
        Ok(())
    }
}
