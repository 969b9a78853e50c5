//! Model loading and the decoder forward pass.

pub mod arch;
pub mod config;
pub mod cuda;
pub mod decoder;
pub mod fingerprint;
pub mod host_launches;
pub mod loader;
pub mod quant;
pub mod quant_fp8;
pub mod quant_int4;
pub mod quant_q8;
pub mod runner;
pub mod safetensors;
mod safetensors_header;
mod safetensors_json;
mod safetensors_view;
pub mod transformer;
pub mod weight_upload;
pub mod weights;

pub use crate::backend::cpu::{ForwardWorkspace, StepBuffers, WorkspacePlan};
pub use crate::forward::ForwardBatch;
pub use crate::forward::StepStop;
pub use crate::memory::WorkspaceStats;
pub use config::{Architecture, ModelConfig};
pub use decoder::Decoder;
pub use host_launches::HostLaunches;
pub use quant::{QuantMethod, QuantMode};
pub use runner::{
    ContextShape, CpuDecoder, DeviceDecoder, ForwardContext, KvBudget, NON_FINITE_ROW,
};
pub use weights::{WeightDType, WeightSource};
