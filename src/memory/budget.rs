//! The memory budget of a session: how its KV capacity was decided and what
//! the rest of memory holds (weights, the planned step workspace).

use std::fmt;

use crate::forward::KvCacheDType;
use crate::{Error, ErrorKind, Result};

/// Where a session's KV capacity came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BudgetSource {
    /// An explicit token (slot) count.
    Tokens,
    /// An explicit byte budget.
    Bytes,
    /// A fraction of total memory minus weights minus the workspace peak
    /// (vLLM's `gpu_memory_utilization` semantics).
    Utilization,
    /// The device's automatic default (CPU: a quarter of available memory,
    /// at most 2 GiB; GPU: `gpu_memory_utilization`).
    #[default]
    Automatic,
}

impl BudgetSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetSource::Tokens => "tokens",
            BudgetSource::Bytes => "bytes",
            BudgetSource::Utilization => "utilization",
            BudgetSource::Automatic => "automatic",
        }
    }
}

/// The memory facts of a device that a budget needs, as the decoder reports
/// them for one context shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Memory of the device in total (host: `MemTotal`); 0 when unknown.
    pub total_bytes: usize,
    /// Memory available now (host: `MemAvailable`); 0 when unknown.
    pub available_bytes: usize,
    /// Bytes the model's weights occupy.
    pub weights_bytes: usize,
    /// Planned peak of one step's temporaries.
    pub workspace_bytes: usize,
    /// Peak temporaries a profiling forward measured (GPU automatic budget;
    /// 0 when no profile ran). It can exceed `workspace_bytes`: see
    /// `CudaDecoder::default_kv_budget`.
    pub profiled_peak_bytes: usize,
}

/// A session's budget report: what memory holds and what the KV cache got.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryBudget {
    pub source: BudgetSource,
    /// The utilization fraction applied (`Utilization`, or a GPU's automatic budget); 0 otherwise.
    pub utilization: f32,
    pub total_bytes: usize,
    pub available_bytes: usize,
    pub weights_bytes: usize,
    /// Planned peak of the step workspace, plus the session's logits buffer.
    pub workspace_bytes: usize,
    /// Peak of a step's temporaries as measured by a profiling forward at
    /// the session's largest batch (GPU automatic budgets); 0 when the
    /// budget was not profiled.
    pub profiled_peak_bytes: usize,
    /// Bytes the KV storage holds (slots × bytes per slot, null block included).
    pub kv_bytes: usize,
    pub kv_bytes_per_token: usize,
    /// What the KV cache stores.
    pub kv_dtype: KvCacheDType,
    /// Tokens per block (1 for the token pool).
    pub kv_block_size: usize,
    /// Usable blocks (tokens / block size).
    pub kv_blocks: usize,
    /// Usable KV slots: the requested capacity rounded up to whole blocks.
    pub kv_tokens: usize,
    /// The model's context length.
    pub context_tokens: usize,
    /// Sequences that fit at once when each uses the full context.
    pub max_full_context_seqs: usize,
    /// True when a utilization budget was lowered to the memory available now.
    pub limited_by_available: bool,
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(f, "memory budget ({}", self.source.as_str())?;
        if self.utilization > 0.0 {
            write!(f, " {:.2}", self.utilization)?;
        }
        write!(f, "): ")?;
        if self.total_bytes > 0 {
            write!(
                f,
                "total {:.0} MiB, available {:.0} MiB, ",
                mib(self.total_bytes),
                mib(self.available_bytes)
            )?;
        }
        write!(
            f,
            "weights {:.1} MiB, workspace {:.1} MiB, ",
            mib(self.weights_bytes),
            mib(self.workspace_bytes),
        )?;
        if self.profiled_peak_bytes > 0 {
            write!(
                f,
                "profiled peak temporaries {:.1} MiB, ",
                mib(self.profiled_peak_bytes)
            )?;
        }
        write!(
            f,
            "KV {:.1} MiB = {} blocks × {} = {} tokens ({} bytes each{}); {} sequence(s) at the \
             full {}-token context",
            mib(self.kv_bytes),
            self.kv_blocks,
            self.kv_block_size,
            self.kv_tokens,
            self.kv_bytes_per_token,
            match self.kv_dtype {
                KvCacheDType::Auto => "",
                KvCacheDType::Fp8E4m3 => ", fp8 e4m3",
            },
            self.max_full_context_seqs,
            self.context_tokens
        )?;
        if self.limited_by_available {
            write!(f, " (lowered to the memory available now)")?;
        }
        Ok(())
    }
}

/// vLLM's rule: the KV cache gets `utilization × total` minus the weights
/// and the workspace peak, and never more than is available now minus the
/// workspace. Returns the bytes and whether the available memory lowered them.
/// Fails with `OutOfMemory` when nothing is left.
pub fn utilization_kv_bytes(mem: &DeviceMemory, utilization: f32) -> Result<(usize, bool)> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(Error::invalid_arg(format!(
            "memory utilization must be in (0, 1], got {utilization}"
        )));
    }
    if mem.total_bytes == 0 {
        return Err(Error::unsupported(
            "a memory utilization budget needs the device's total memory, which it does not \
             report; set kv_memory_bytes or kv_capacity_tokens",
        ));
    }
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let allowed = (mem.total_bytes as f64 * utilization as f64) as usize;
    let by_total = allowed
        .checked_sub(mem.weights_bytes + mem.workspace_bytes)
        .filter(|&b| b > 0)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "no memory left for the KV cache: {:.2} GiB allowed ({:.0}% of {:.2} GiB) but \
                     the weights take {:.2} GiB and the step workspace {:.2} GiB; raise the \
                     memory utilization or set kv_memory_bytes",
                    gib(allowed),
                    utilization * 100.0,
                    gib(mem.total_bytes),
                    gib(mem.weights_bytes),
                    gib(mem.workspace_bytes)
                ),
            )
        })?;
    if mem.available_bytes == 0 {
        return Ok((by_total, false));
    }
    let by_available = mem.available_bytes.saturating_sub(mem.workspace_bytes);
    Ok(if by_available < by_total {
        (by_available, true)
    } else {
        (by_total, false)
    })
}

/// Refuses a session whose KV cache (`kv_bytes`, None when its size
/// overflows) and step workspace together exceed the memory available now
/// (`mem.available_bytes`; on the host the least of `MemAvailable`, the
/// cgroup limit minus usage and RLIMIT_AS minus the address space in use:
/// see `crate::sysinfo`). Without the check an explicit size is accepted
/// and fails later, in the allocator or under the OOM killer. `requested`
/// names what the caller set. Unknown available memory (0) checks nothing.
pub fn check_fits(mem: &DeviceMemory, requested: &str, kv_bytes: Option<usize>) -> Result<()> {
    let need = kv_bytes.and_then(|kv| kv.checked_add(mem.workspace_bytes));
    let available = mem.available_bytes;
    if available == 0 || need.is_some_and(|n| n <= available) {
        return Ok(());
    }
    let kv = kv_bytes.map_or_else(|| "more than usize::MAX".to_string(), |b| b.to_string());
    Err(Error::new(
        ErrorKind::OutOfMemory,
        format!(
            "{requested} needs {kv} bytes of KV cache plus {} bytes of step workspace, more than \
             the {available} bytes of memory available to this process (on the host: the least \
             of MemAvailable, the cgroup memory limit minus usage and RLIMIT_AS minus the address \
             space in use); lower it",
            mem.workspace_bytes
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    fn mem(total: usize, available: usize, weights: usize, workspace: usize) -> DeviceMemory {
        DeviceMemory {
            total_bytes: total,
            available_bytes: available,
            weights_bytes: weights,
            workspace_bytes: workspace,
            profiled_peak_bytes: 0,
        }
    }

    #[test]
    fn utilization_subtracts_weights_and_workspace() {
        let m = mem(10 * GIB, 10 * GIB, 2 * GIB, GIB);
        let (kv, limited) = utilization_kv_bytes(&m, 0.5).unwrap();
        assert_eq!(kv, 2 * GIB);
        assert!(!limited);
    }

    #[test]
    fn utilization_is_capped_by_available_memory() {
        let m = mem(10 * GIB, 3 * GIB, GIB, GIB);
        let (kv, limited) = utilization_kv_bytes(&m, 0.9).unwrap();
        assert_eq!(kv, 2 * GIB);
        assert!(limited);
    }

    #[test]
    fn nothing_left_is_out_of_memory() {
        let m = mem(4 * GIB, 4 * GIB, 3 * GIB, GIB);
        let e = utilization_kv_bytes(&m, 0.9).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(e.message.contains("weights"), "{}", e.message);
    }

    #[test]
    fn bad_fraction_and_unknown_total_are_refused() {
        let m = mem(4 * GIB, 4 * GIB, 0, 0);
        for f in [0.0, -0.1, 1.5, f32::NAN] {
            assert_eq!(
                utilization_kv_bytes(&m, f).unwrap_err().kind,
                ErrorKind::InvalidArgument
            );
        }
        let unknown = mem(0, 0, 0, 0);
        assert_eq!(
            utilization_kv_bytes(&unknown, 0.5).unwrap_err().kind,
            ErrorKind::Unsupported
        );
    }

    #[test]
    fn a_session_larger_than_the_available_memory_is_refused() {
        let m = mem(8 * GIB, 2 * GIB, GIB, GIB / 2);
        check_fits(&m, "kv_capacity_tokens 9", Some(GIB)).unwrap();
        for kv in [Some(2 * GIB), Some(usize::MAX), None] {
            let e = check_fits(&m, "kv_capacity_tokens 9", kv).unwrap_err();
            assert_eq!(e.kind, ErrorKind::OutOfMemory);
            assert!(
                e.message.starts_with("kv_capacity_tokens 9 needs"),
                "{}",
                e.message
            );
            assert!(e.message.contains(&(2 * GIB).to_string()), "{}", e.message);
        }
        // Unknown available memory: nothing to check against.
        check_fits(&mem(0, 0, 0, 0), "x", None).unwrap();
    }

    #[test]
    fn display_shows_the_profiled_peak_only_when_profiled() {
        let mut b = MemoryBudget {
            weights_bytes: 1 << 20,
            workspace_bytes: 2 << 20,
            kv_bytes: 4 << 20,
            ..MemoryBudget::default()
        };
        let text = b.to_string();
        assert!(text.contains("workspace 2.0 MiB, KV 4.0 MiB"), "{text}");
        assert!(!text.contains("profiled"), "{text}");
        b.profiled_peak_bytes = 3 << 20;
        let text = b.to_string();
        assert!(
            text.contains("workspace 2.0 MiB, profiled peak temporaries 3.0 MiB, KV 4.0 MiB"),
            "{text}"
        );
        assert!(!text.contains("fp8"), "{text}");
        b.kv_bytes_per_token = 64;
        b.kv_dtype = KvCacheDType::Fp8E4m3;
        let text = b.to_string();
        assert!(text.contains("(64 bytes each, fp8 e4m3)"), "{text}");
    }
}
