//! The serving engine: models, sessions, scheduling, requests and events.

pub mod eval;
pub mod faults;
pub mod model;
pub mod policy;
pub mod request;
pub mod session;

pub use faults::{FaultCounts, FaultPlan};
pub use model::{Model, ModelParams};
pub use policy::SchedulePolicyKind;
pub use request::{Event, FinishReason, RequestId, RequestParams, TokenLogprob, Usage};
pub use session::{PreemptionMode, Session, SessionParams, SessionStats, StepShape};
