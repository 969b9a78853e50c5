//! Scheduling policies: who is admitted first, and who is preempted first.

use crate::{bail_arg, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulePolicyKind {
    /// First come, first served.
    Fcfs,
    /// Lower `priority` first; waiting requests gain one level per `aging_steps`
    /// steps so nothing starves.
    Priority,
}

impl std::str::FromStr for SchedulePolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "fcfs" => SchedulePolicyKind::Fcfs,
            "priority" => SchedulePolicyKind::Priority,
            _ => bail_arg!("scheduling policy `{s}` is not supported (supported: fcfs, priority)"),
        })
    }
}

/// What a policy may look at.
#[derive(Debug, Clone, Copy)]
pub struct RankInput {
    pub priority: i32,
    /// Monotonic admission counter (earlier = smaller).
    pub arrival: u64,
    /// Engine step at which the request arrived.
    pub arrival_step: u64,
}

pub trait SchedulePolicy: Send {
    /// Sort key at engine step `now`: smaller runs first and is preempted last.
    fn rank(&self, r: &RankInput, now: u64) -> (i64, u64);
}

pub struct Fcfs;

impl SchedulePolicy for Fcfs {
    fn rank(&self, r: &RankInput, _now: u64) -> (i64, u64) {
        (0, r.arrival)
    }
}

pub struct PriorityWithAging {
    /// Steps a request must wait to gain one priority level.
    pub aging_steps: u64,
}

impl SchedulePolicy for PriorityWithAging {
    fn rank(&self, r: &RankInput, now: u64) -> (i64, u64) {
        let waited = now.saturating_sub(r.arrival_step) as i64;
        let aging = self.aging_steps.max(1) as i64;
        (r.priority as i64 * aging - waited, r.arrival)
    }
}

pub fn create_policy(kind: SchedulePolicyKind, aging_steps: u64) -> Box<dyn SchedulePolicy> {
    match kind {
        SchedulePolicyKind::Fcfs => Box::new(Fcfs),
        SchedulePolicyKind::Priority => Box::new(PriorityWithAging { aging_steps }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_orders_by_level_then_arrival_and_ages() {
        let p = PriorityWithAging { aging_steps: 10 };
        let low_old = RankInput {
            priority: 5,
            arrival: 1,
            arrival_step: 0,
        };
        let high_new = RankInput {
            priority: 0,
            arrival: 2,
            arrival_step: 0,
        };
        assert!(p.rank(&high_new, 0) < p.rank(&low_old, 0));
        // After waiting 60 steps the low-priority request overtakes a fresh urgent one.
        let fresh = RankInput {
            priority: 0,
            arrival: 3,
            arrival_step: 60,
        };
        assert!(p.rank(&low_old, 60) < p.rank(&fresh, 60));
        assert!(Fcfs.rank(&low_old, 0) < Fcfs.rank(&high_new, 0));
    }
}
