//! A switch that makes a step workspace's next step fail inside its pool,
//! for fault-injection tests of the engine. The session holds one end and
//! the context it creates the other (through `ContextShape`), so the forward
//! contract carries no testing method. Disarmed, it costs one relaxed load
//! per step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Shared between a session and its context's workspace; clones arm the
/// same switch.
#[derive(Debug, Clone, Default)]
pub struct PoolFaultSwitch(Arc<AtomicBool>);

impl PoolFaultSwitch {
    /// The next workspace step asks its pool for an impossible amount of
    /// memory after its first buffer, so the pool's own out-of-memory
    /// error fails that step.
    pub fn arm(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether the switch was armed; disarms it.
    pub fn take(&self) -> bool {
        // The load keeps the common (disarmed) case free of a write.
        self.0.load(Ordering::Relaxed) && self.0.swap(false, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_fires_once_per_arming_and_clones_share_it() {
        let session_end = PoolFaultSwitch::default();
        let context_end = session_end.clone();
        assert!(!context_end.take());
        session_end.arm();
        assert!(context_end.take());
        assert!(!context_end.take());
    }
}
