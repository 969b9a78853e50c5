//! Token sampling: per-request parameters, logits processors, seeded RNG, stop strings.
//!
//! `SamplingParams` (validated once per request) resolves to a `SamplingPlan`;
//! a per-request `Sampler` runs the fixed stage chain documented in
//! `processors` on one logits row and draws with its own `Rng` stream.
//! `StopMatcher` applies stop strings to the detokenized stream.

pub mod candidates;
mod grammar;
pub mod history;
mod math;
pub mod params;
pub mod processors;
pub mod rng;
pub mod sampler;
pub mod stop;

pub use crate::forward::{mask_words, DeviceSampling, MaskFill, RowSampling};
pub use candidates::CandidateSet;
pub use grammar::{GrammarMask, MaskStats, MASK_TIME_BUDGET};
pub use history::TokenHistory;
pub use math::{check_finite_logits, non_finite_logits};
pub use params::{SamplingParams, SamplingPlan};
pub use rng::Rng;
pub use sampler::{SampledToken, Sampler};
pub use stop::{StopMatcher, StopOutput};
