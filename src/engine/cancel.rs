//! Cancelling requests from other threads without waiting for a step.
//!
//! A [`Session`](super::Session) is driven by one thread at a time; a CPU
//! prefill step of a long prompt can take seconds. A [`Canceller`] accepts
//! a cancel at once from any thread: it checks that the request is active,
//! queues it for the session, and when the request is part of the step
//! running now raises the step's stop flag, so the forward ends at its next
//! check (see `forward::StepStop`). The session applies queued cancels when it
//! next holds itself: at the start of every step, after an interrupted
//! forward, or right away through [`Session::apply_cancels`] when no step
//! is running.
//!
//! [`Session::apply_cancels`]: super::Session::apply_cancels

use super::request::RequestId;
use crate::{bail_arg, Result};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Default)]
struct Registry {
    /// Accepted requests whose end (terminal event or cancel) is not yet decided.
    active: HashSet<RequestId>,
    /// Cancels accepted but not yet applied by the session.
    pending: Vec<RequestId>,
    /// Requests in the forward that is running now.
    in_step: Vec<RequestId>,
}

#[derive(Default)]
struct Shared {
    registry: Mutex<Registry>,
    /// Raised while the running step holds a cancelled request.
    stop: AtomicBool,
}

/// A handle that cancels requests of one session from any thread, without
/// waiting for a running step. Cheap to clone.
#[derive(Clone, Default)]
pub struct Canceller {
    shared: Arc<Shared>,
}

impl Canceller {
    /// Cancels a waiting or running request. Its terminal event (reason
    /// `Cancelled`) comes from the session's next step; a step that is
    /// running now and holds the request stops within one layer. Once this
    /// returns `Ok` the request ends `Cancelled`, even if the running step
    /// completes it. An unknown, finished or already cancelled id is refused.
    pub fn cancel(&self, id: RequestId) -> Result<()> {
        let mut r = self.lock();
        if !r.active.remove(&id) {
            bail_arg!("request {id} is not active (unknown, finished or already cancelled)");
        }
        r.pending.push(id);
        if r.in_step.contains(&id) {
            self.shared.stop.store(true, Ordering::Release);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // The registry's updates cannot be left half done (no call in them
        // panics), so a poisoned lock still guards consistent data.
        self.shared
            .registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The flag the running forward polls.
    pub(super) fn stop_flag(&self) -> &AtomicBool {
        &self.shared.stop
    }

    pub(super) fn admit(&self, id: RequestId) {
        self.lock().active.insert(id);
    }

    /// `id` ends (finished, or cancelled by the session's owner): a cancel
    /// from another thread is refused from now on. Returns false when such a
    /// cancel came first, so the end must be reported as a cancel.
    pub(super) fn forget(&self, id: RequestId) -> bool {
        self.lock().active.remove(&id)
    }

    /// Moves the cancels accepted so far into `out` (cleared first).
    pub(super) fn take_pending(&self, out: &mut Vec<RequestId>) {
        out.clear();
        std::mem::swap(&mut self.lock().pending, out);
    }

    /// A forward over `ids` starts. The stop flag is raised at once when
    /// one of them was cancelled since the step began.
    pub(super) fn begin_forward(&self, ids: impl Iterator<Item = RequestId>) {
        let mut r = self.lock();
        let Registry {
            pending, in_step, ..
        } = &mut *r;
        in_step.clear();
        in_step.extend(ids);
        let hit = pending.iter().any(|id| in_step.contains(id));
        self.shared.stop.store(hit, Ordering::Release);
    }

    /// The forward ended; returns whether it was asked to stop for a cancel.
    pub(super) fn end_forward(&self) -> bool {
        let mut r = self.lock();
        r.in_step.clear();
        self.shared.stop.swap(false, Ordering::AcqRel)
    }
}
