//! Ending a running forward pass early, between layers.
//!
//! A CPU prefill step of a long prompt takes seconds; an app that cancels
//! the request, or aborts the step, should not wait for it. The forward
//! checks a [`StepStop`] at a few points of every layer (a layer is tens of
//! milliseconds at most) and returns [`ErrorKind::Cancelled`] when it is
//! raised. The keys and values written so far belong to tokens the engine
//! has not committed, so the step can simply be run again.

use crate::{Error, ErrorKind, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// What a forward polls to learn that it should stop: a flag another
/// thread raises, and the app's callback.
#[derive(Clone, Copy)]
pub struct StepStop<'a> {
    /// Raised when a request of this step is cancelled.
    pub cancel: &'a AtomicBool,
    /// Returns true to abort the step; called on the stepping thread.
    pub abort: Option<&'a (dyn Fn() -> bool + Send + Sync)>,
}

impl StepStop<'_> {
    /// `Err(Cancelled)` when the step should stop now. The caller tells the
    /// two causes apart by the flag: it stays raised until the engine lowers it.
    pub fn check(&self) -> Result<()> {
        let why = if self.cancel.load(Ordering::Acquire) {
            "the step was interrupted: a request in it was cancelled"
        } else if self.abort.is_some_and(|abort| abort()) {
            "the step was aborted by the abort callback"
        } else {
            return Ok(());
        };
        Err(Error::new(ErrorKind::Cancelled, why))
    }
}

/// Checks `stop` when there is one.
pub fn check_stop(stop: Option<&StepStop<'_>>) -> Result<()> {
    stop.map_or(Ok(()), StepStop::check)
}
