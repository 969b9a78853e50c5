//! The serving engine: models, sessions, scheduling, requests and events.

pub mod cancel;
pub mod eval;
pub mod faults;
pub mod grammar;
pub mod model;
pub mod policy;
pub mod request;
pub mod session;
pub mod speculative;
pub mod state_file;

pub use cancel::Canceller;
pub use faults::{FaultCounts, FaultPlan};
pub use model::{Model, ModelParams};
pub use policy::SchedulePolicyKind;
pub use request::{Constraint, Event, FinishReason, RequestId, RequestParams, TokenLogprob, Usage};
pub use session::{
    AbortCheck, PreemptionMode, PrefixCacheReport, Session, SessionParams, SessionStats, StepShape,
    PREFIX_CACHE_FILE,
};
pub use speculative::{SpeculativeMethod, SpeculativeParams};
pub use state_file::StateIdentity;
