//! Per-kernel GPU time (`NANOINFER_CUDA_PROFILE=1`), for finding where a
//! step's time goes on machines without Nsight: every launch is bracketed by
//! two events, resolved at the next stream synchronization, and the totals
//! are printed to stderr when the device closes. While profiling, the decoder
//! runs without CUDA graphs and programmatic launch, so kernels do not
//! overlap and each one's time is its own.

use super::cuda_error;
use crate::Result;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Default)]
struct Total {
    count: u64,
    ms: f64,
    /// Bytes of weights the op streams (GEMMs), for a bandwidth column.
    bytes: f64,
}

pub struct Profiler {
    ctx: Arc<CudaContext>,
    pending: Vec<(String, usize, CudaEvent, CudaEvent)>,
    totals: HashMap<String, Total>,
}

impl Profiler {
    pub fn from_env(ctx: &Arc<CudaContext>) -> Option<Profiler> {
        let on = std::env::var("NANOINFER_CUDA_PROFILE").is_ok_and(|v| v != "0");
        on.then(|| Profiler {
            ctx: ctx.clone(),
            pending: Vec::new(),
            totals: HashMap::new(),
        })
    }

    fn event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        let event = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        event
            .record(stream)
            .map_err(|e| cuda_error("cuEventRecord", e))?;
        Ok(event)
    }

    /// Times what `op` enqueues on `stream` under `label`.
    pub fn time(
        &mut self,
        stream: &CudaStream,
        label: impl FnOnce() -> String,
        bytes: usize,
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let start = self.event(stream)?;
        op()?;
        let end = self.event(stream)?;
        self.pending.push((label(), bytes, start, end));
        Ok(())
    }

    /// Adds the finished ops' times to the totals (after a synchronize).
    pub fn collect(&mut self) -> Result<()> {
        for (label, bytes, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| cuda_error("cuEventElapsedTime", e))?;
            let t = self.totals.entry(label).or_default();
            t.count += 1;
            t.ms += ms as f64;
            t.bytes += bytes as f64;
        }
        Ok(())
    }

    /// One line per label, the most expensive first.
    pub fn report(&self) -> String {
        let mut rows: Vec<_> = self.totals.iter().collect();
        rows.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms));
        let all: f64 = rows.iter().map(|r| r.1.ms).sum();
        let mut out = format!(
            "NANOINFER_CUDA_PROFILE: {all:.1} ms of kernels\n{:>10} {:>6} {:>8} {:>10} {:>8}  op\n",
            "total ms", "%", "count", "avg us", "GB/s"
        );
        for (label, t) in rows {
            let gbs = if t.bytes > 0.0 {
                format!("{:.0}", t.bytes / (t.ms * 1e6))
            } else {
                String::new()
            };
            out += &format!(
                "{:>10.2} {:>6.1} {:>8} {:>10.1} {:>8}  {label}\n",
                t.ms,
                100.0 * t.ms / all.max(1e-9),
                t.count,
                1e3 * t.ms / t.count as f64,
                gbs
            );
        }
        out
    }
}
