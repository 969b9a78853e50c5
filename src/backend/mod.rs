//! Compute backends: the ops a decoder needs, per device.

mod context_shape;
pub mod cpu;
pub mod cuda;
pub mod layer_ops;

pub use context_shape::{ContextShape, KvBudget};
pub use layer_ops::{
    Activations, DecoderDims, DecoderWeights, LayerKv, LayerOps, LayerWeights, LmHead,
    WeightFormats,
};

/// Where a model's weights live and its kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" || s == "gpu" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            if let Ok(n) = n.parse() {
                return Ok(Device::Cuda(n));
            }
        }
        crate::bail_arg!("device `{s}` is not supported (supported: cpu, cuda, cuda:N)")
    }
}
