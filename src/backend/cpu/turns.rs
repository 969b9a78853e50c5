//! Whole forward passes take turns on a shared thread pool.
//!
//! Every session of a model computes on the model's one pool. Two sessions
//! stepping at once would otherwise interleave op by op: each caller thread
//! runs its serial code (norms, RoPE, sampling) while the other's parallel
//! op wants every core, so every op waits for a descheduled thread and
//! together they finish later than one after the other. Taking turns per
//! forward, first come first served, keeps each op on all cores and lets
//! the sessions alternate steps fairly.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

/// How often a waiting caller polls its `give_up` check.
const POLL: Duration = Duration::from_millis(2);

#[derive(Default)]
pub struct ForwardTurns {
    /// Tickets of the callers that hold or wait for a turn; the front holds it.
    queue: Mutex<Queue>,
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    tickets: VecDeque<u64>,
    next: u64,
}

/// Holds the turn until dropped.
pub struct Turn<'a> {
    turns: &'a ForwardTurns,
    ticket: u64,
}

impl ForwardTurns {
    /// Waits for this caller's turn, first come first served. `give_up` is
    /// polled while waiting; when it returns true the caller leaves the
    /// queue and gets `None` (a cancelled step should not wait for another
    /// session's step to end).
    pub fn take(&self, give_up: &dyn Fn() -> bool) -> Option<Turn<'_>> {
        let mut q = self.lock();
        let ticket = q.next;
        q.next += 1;
        q.tickets.push_back(ticket);
        while q.tickets.front() != Some(&ticket) {
            if give_up() {
                q.tickets.retain(|&t| t != ticket);
                drop(q);
                self.changed.notify_all();
                return None;
            }
            q = self
                .changed
                .wait_timeout(q, POLL)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Some(Turn {
            turns: self,
            ticket,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // The queue is updated by single calls that cannot panic midway.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut q = self.turns.lock();
        q.tickets.retain(|&t| t != self.ticket);
        drop(q);
        self.turns.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    #[test]
    fn turns_are_exclusive_and_a_waiter_can_give_up() {
        let turns = ForwardTurns::default();
        let inside = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let _turn = turns.take(&|| false).expect("never gives up");
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        let held = turns.take(&|| false).unwrap();
        let give_up = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| turns.take(&|| give_up.load(Ordering::SeqCst)).is_none());
            std::thread::sleep(Duration::from_millis(10));
            give_up.store(true, Ordering::SeqCst);
            assert!(waiter.join().unwrap(), "the waiter gave up");
        });
        drop(held);
        assert!(
            turns.take(&|| true).is_some(),
            "a free turn is taken at once"
        );
    }
}
