//! Fault injection for tests: a session can be told to fail at chosen steps
//! the way real hardware and memory fail (see `Session::inject_faults`).
//! Off unless a test installs a plan; the cost when off is one `Option`
//! check per step and per KV allocation.

use crate::{Error, ErrorKind};

/// Which faults to raise, by session step number (`SessionStats::steps`
/// at the start of the step, counting from 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// During each of these steps that runs a forward pass, the step
    /// workspace's memory pool is asked, mid-step (after the first buffer),
    /// for more memory than any pool can give: the pool's own
    /// out-of-memory error fails the forward pass. Contexts without a
    /// planned workspace (CUDA) ignore this.
    pub pool_failure_steps: Vec<u64>,
    /// During each of these steps every KV allocation reports exhaustion
    /// (the cache behaves as if full).
    pub kv_exhausted_steps: Vec<u64>,
    /// The forward pass of each of these steps (if it runs one) returns an
    /// error instead of running.
    pub forward_error_steps: Vec<u64>,
    /// During each of these steps every swap-out (a swap preemption saving
    /// a request's KV to host memory) fails after copying part of it.
    pub swap_out_failure_steps: Vec<u64>,
    /// During each of these steps every swap-in (restoring saved KV into
    /// the cache) fails after overwriting the first half of its slots with
    /// NaN, as a copy that broke off midway leaves them undefined.
    pub swap_in_failure_steps: Vec<u64>,
}

impl FaultPlan {
    /// The last step the plan names (0 for an empty plan).
    pub fn last_step(&self) -> u64 {
        [
            &self.pool_failure_steps,
            &self.kv_exhausted_steps,
            &self.forward_error_steps,
            &self.swap_out_failure_steps,
            &self.swap_in_failure_steps,
        ]
        .into_iter()
        .flatten()
        .max()
        .copied()
        .unwrap_or(0)
    }
}

/// How many faults of each kind were raised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub pool_failures: u64,
    pub kv_exhaustions: u64,
    pub forward_errors: u64,
    pub swap_out_failures: u64,
    pub swap_in_failures: u64,
}

/// A plan being carried out by one session.
#[derive(Debug)]
pub(crate) struct FaultState {
    plan: FaultPlan,
    /// True during a step listed in `kv_exhausted_steps`.
    kv_exhausted: bool,
    /// True during a step listed in `swap_out_failure_steps`.
    swap_out_fails: bool,
    /// True during a step listed in `swap_in_failure_steps`.
    swap_in_fails: bool,
    pub(crate) counts: FaultCounts,
}

impl FaultState {
    pub(crate) fn new(mut plan: FaultPlan) -> Self {
        // Sorted latest first: the earliest due step is popped from the back.
        for steps in [&mut plan.pool_failure_steps, &mut plan.forward_error_steps] {
            steps.sort_unstable_by(|a, b| b.cmp(a));
        }
        FaultState {
            plan,
            kv_exhausted: false,
            swap_out_fails: false,
            swap_in_fails: false,
            counts: FaultCounts::default(),
        }
    }

    pub(crate) fn begin_step(&mut self, step: u64) {
        self.kv_exhausted = self.plan.kv_exhausted_steps.contains(&step);
        self.swap_out_fails = self.plan.swap_out_failure_steps.contains(&step);
        self.swap_in_fails = self.plan.swap_in_failure_steps.contains(&step);
    }

    /// The error this swap-out must end with, if any (and counts it).
    pub(crate) fn swap_out_error(&mut self, step: u64) -> Option<Error> {
        self.swap_out_fails.then(|| {
            self.counts.swap_out_failures += 1;
            Error::new(
                ErrorKind::Internal,
                format!("injected fault: a swap-out in step {step} failed"),
            )
        })
    }

    /// The error this swap-in must end with, if any (and counts it).
    pub(crate) fn swap_in_error(&mut self, step: u64) -> Option<Error> {
        self.swap_in_fails.then(|| {
            self.counts.swap_in_failures += 1;
            Error::new(
                ErrorKind::Internal,
                format!("injected fault: a swap-in in step {step} failed"),
            )
        })
    }

    /// Whether this KV allocation must fail (and counts it).
    pub(crate) fn kv_allocation_fails(&mut self) -> bool {
        if self.kv_exhausted {
            self.counts.kv_exhaustions += 1;
        }
        self.kv_exhausted
    }

    /// Whether the workspace pool must fail during this step's forward pass.
    pub(crate) fn take_pool_failure(&mut self, step: u64) -> bool {
        let due = take_due(&mut self.plan.pool_failure_steps, step);
        if due {
            self.counts.pool_failures += 1;
        }
        due
    }

    /// The error this step's forward pass must return, if any.
    pub(crate) fn take_forward_error(&mut self, step: u64) -> Option<Error> {
        take_due(&mut self.plan.forward_error_steps, step).then(|| {
            self.counts.forward_errors += 1;
            Error::new(
                ErrorKind::Internal,
                format!("injected fault: the forward pass of step {step} failed"),
            )
        })
    }
}

/// Whether `step` is listed; drops the entries it passed (earliest last).
fn take_due(steps: &mut Vec<u64>, step: u64) -> bool {
    let mut due = false;
    while let Some(&s) = steps.last() {
        if s > step {
            break;
        }
        due |= s == step;
        steps.pop();
    }
    due
}
