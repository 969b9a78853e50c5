//! Per-kernel GPU time (`NANOINFER_CUDA_PROFILE=N`), for finding where a
//! step's time goes on machines without Nsight: every launch is bracketed by
//! two events, resolved at the next stream synchronization, and the totals
//! are printed to stderr when the device closes. With N > 1 each launch runs
//! N times between its events (the results are then garbage: kernels that
//! update in place run repeatedly), which amortizes the event overhead of
//! small kernels. The first call of each op (lazy module loading, cuBLAS
//! heuristics) is left out. While profiling, the decoder runs without CUDA
//! graphs and programmatic launch, so kernels do not overlap.

use super::cuda_error;
use crate::Result;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Default)]
struct Total {
    /// Calls, the first (left out of the figures) included.
    seen: u64,
    count: u64,
    ms: f64,
    /// Bytes of weights the op streams (GEMMs), for a bandwidth column.
    bytes: f64,
}

pub struct Profiler {
    ctx: Arc<CudaContext>,
    repeats: usize,
    pending: Vec<(String, usize, CudaEvent, CudaEvent)>,
    totals: HashMap<String, Total>,
}

impl Profiler {
    pub fn from_env(ctx: &Arc<CudaContext>) -> Option<Profiler> {
        let repeats = crate::tuning::var("NANOINFER_CUDA_PROFILE")?
            .parse::<usize>()
            .unwrap_or(1);
        (repeats > 0).then(|| Profiler {
            ctx: ctx.clone(),
            repeats,
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
        op: impl Fn() -> Result<()>,
    ) -> Result<()> {
        let start = self.event(stream)?;
        for _ in 0..self.repeats {
            op()?;
        }
        let end = self.event(stream)?;
        self.pending.push((label(), bytes, start, end));
        Ok(())
    }

    /// Adds the finished ops' times to the totals (after a synchronize).
    pub fn collect(&mut self) -> Result<()> {
        for (label, bytes, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| cuda_error("cuEventElapsedTime", e))?
                / self.repeats as f32;
            let t = self.totals.entry(label).or_default();
            t.seen += 1;
            if t.seen == 1 {
                continue;
            }
            t.count += 1;
            t.ms += ms as f64;
            t.bytes += bytes as f64;
        }
        Ok(())
    }

    /// One line per label, the most expensive first.
    pub fn report(&self) -> String {
        let mut rows: Vec<_> = self.totals.iter().filter(|r| r.1.count > 0).collect();
        rows.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms));
        let all: f64 = rows.iter().map(|r| r.1.ms).sum();
        let mut out = format!(
            "NANOINFER_CUDA_PROFILE: {all:.1} ms of kernels ({} runs per launch)\n{:>10} {:>6} {:>8} {:>10} {:>8}  op\n",
            self.repeats,
            "total ms",
            "%",
            "count",
            "avg us",
            "GB/s"
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
