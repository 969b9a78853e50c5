//! Step temporaries of the CPU forward pass, planned up front from the model
//! config and the session's batching limits and taken from the session's
//! memory pool every step.
//!
//! With the arena (the default) the pool is one region sized to the planned
//! peak: a step is a reset plus a dozen bump allocations, and no system
//! allocation happens once the session exists. A step larger than planned
//! (a caller outside the session's limits) resizes the arena explicitly and
//! logs it. The slab and system pools take memory as it is asked for.

use std::time::Instant;

use crate::backend::layer_ops::DecoderDims;
use crate::memory::{MemoryPoolKind, PoolFaultSwitch, Workspace, WorkspaceStats, WORKSPACE_ALIGN};
use crate::Result;

/// Buffer lengths (in f32) of one step, from the model's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspacePlan {
    d: usize,
    qkv: usize,
    nq: usize,
    inter: usize,
    half: usize,
    vocab: usize,
    /// The limits the plan's peak is computed for.
    pub max_rows: usize,
    pub max_logits_rows: usize,
}

impl WorkspacePlan {
    pub fn new(dims: &DecoderDims, max_rows: usize, max_logits_rows: usize) -> Self {
        WorkspacePlan {
            d: dims.hidden,
            qkv: dims.qkv_width(),
            nq: dims.q_width(),
            inter: dims.intermediate,
            half: dims.head_dim / 2,
            vocab: dims.vocab,
            max_rows: max_rows.max(1),
            max_logits_rows: max_logits_rows.max(1),
        }
    }

    /// f32 lengths of the buffers of a step with `rows` rows, `out_rows`
    /// logits rows and `logits` pool-held logits values, in `StepBuffers` order.
    fn lengths(&self, rows: usize, out_rows: usize, logits: usize) -> [usize; 11] {
        [
            rows * self.d,               // hidden
            rows.max(out_rows) * self.d, // normed
            rows * self.qkv,             // qkv
            rows * self.nq,              // attn
            rows * self.d,               // proj
            rows * 2 * self.inter,       // gate_up
            rows * self.inter,           // act
            rows * self.half,            // cos
            rows * self.half,            // sin
            out_rows * self.d,           // selected
            logits,                      // logits (argmax path)
        ]
    }

    /// Bytes a step takes from a pool: each buffer rounded up to the
    /// workspace alignment, as the arena places them.
    pub fn step_bytes(&self, rows: usize, out_rows: usize, logits: usize) -> usize {
        self.lengths(rows, out_rows, logits)
            .iter()
            .map(|&n| (n * 4).next_multiple_of(WORKSPACE_ALIGN))
            .sum()
    }

    /// The planned peak: a step of `max_rows` rows whose `max_logits_rows`
    /// logits stay in the pool (the greedy path).
    pub fn peak_bytes(&self) -> usize {
        self.step_bytes(
            self.max_rows,
            self.max_logits_rows,
            self.max_logits_rows * self.vocab,
        )
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// One step's buffers, borrowed from the workspace until the next step.
pub struct StepBuffers<'a> {
    pub hidden: &'a mut [f32],
    pub normed: &'a mut [f32],
    pub qkv: &'a mut [f32],
    pub attn: &'a mut [f32],
    pub proj: &'a mut [f32],
    pub gate_up: &'a mut [f32],
    pub act: &'a mut [f32],
    pub cos: &'a mut [f32],
    pub sin: &'a mut [f32],
    pub selected: &'a mut [f32],
    /// Logits kept in the pool (empty unless asked for).
    pub logits: &'a mut [f32],
}

/// A context's step workspace: the plan and the pool it draws from.
pub struct ForwardWorkspace {
    ws: Workspace,
    plan: WorkspacePlan,
    kind: MemoryPoolKind,
    resizes: u64,
    steps: u64,
    acquire_ns: u64,
    /// Fault injection: armed, the next `step` fails inside the pool.
    fault: PoolFaultSwitch,
}

impl ForwardWorkspace {
    /// A workspace over a new pool of `kind`; an arena is allocated at the
    /// plan's peak at once.
    pub fn new(kind: MemoryPoolKind, plan: WorkspacePlan, fault: PoolFaultSwitch) -> Result<Self> {
        let initial = match kind {
            MemoryPoolKind::Arena => plan.peak_bytes(),
            _ => 0,
        };
        let ws: Workspace = match kind {
            MemoryPoolKind::Arena => crate::memory::CpuArena::fixed(initial)?.into(),
            _ => Workspace::with_kind(kind, 0)?,
        };
        Ok(ForwardWorkspace {
            ws,
            plan,
            kind,
            resizes: 0,
            steps: 0,
            acquire_ns: 0,
            fault,
        })
    }

    pub fn plan(&self) -> &WorkspacePlan {
        &self.plan
    }

    /// Reclaims the previous step's buffers and hands out this step's:
    /// `rows` rows, `out_rows` logits rows and `logits` values of logits
    /// kept in the pool. Every buffer is zeroed.
    pub fn step(&mut self, rows: usize, out_rows: usize, logits: usize) -> Result<StepBuffers<'_>> {
        let start = Instant::now();
        let ForwardWorkspace {
            ws,
            plan,
            resizes,
            steps,
            acquire_ns,
            fault,
            ..
        } = self;
        let need = plan.step_bytes(rows, out_rows, logits);
        if ws.reserve(need)? {
            *resizes += 1;
        }
        *steps += 1;
        let [hidden, normed, qkv, attn, proj, gate_up, act, cos, sin, selected, logits] =
            plan.lengths(rows, out_rows, logits);
        let ws: &Workspace = ws;
        let hidden = ws.alloc_zeroed(hidden)?;
        if fault.take() {
            // Valid as a layout, beyond any address space: every pool kind
            // reaches its own out-of-memory path.
            ws.alloc_zeroed::<u8>(isize::MAX as usize / 2)?;
        }
        let buffers = StepBuffers {
            hidden,
            normed: ws.alloc_zeroed(normed)?,
            qkv: ws.alloc_zeroed(qkv)?,
            attn: ws.alloc_zeroed(attn)?,
            proj: ws.alloc_zeroed(proj)?,
            gate_up: ws.alloc_zeroed(gate_up)?,
            act: ws.alloc_zeroed(act)?,
            cos: ws.alloc_zeroed(cos)?,
            sin: ws.alloc_zeroed(sin)?,
            selected: ws.alloc_zeroed(selected)?,
            logits: ws.alloc_zeroed(logits)?,
        };
        *acquire_ns += start.elapsed().as_nanos() as u64;
        Ok(buffers)
    }

    pub fn stats(&self) -> WorkspaceStats {
        WorkspaceStats {
            pool: self.kind,
            planned_bytes: self.plan.peak_bytes(),
            pool_stats: self.ws.stats(),
            resizes: self.resizes,
            steps: self.steps,
            acquire_ns: self.acquire_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DecoderDims {
        DecoderDims {
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 160,
            vocab: 100,
            layers: 2,
            rms_norm_eps: 1e-5,
        }
    }

    #[test]
    fn the_arena_is_sized_to_the_plan_and_a_step_fills_it_exactly() {
        let plan = WorkspacePlan::new(&config(), 16, 4);
        let mut ws =
            ForwardWorkspace::new(MemoryPoolKind::Arena, plan, PoolFaultSwitch::default()).unwrap();
        assert_eq!(ws.stats().pool_stats.capacity_bytes, plan.peak_bytes());
        for (rows, out, logits) in [(16, 4, 400), (1, 1, 100), (7, 3, 0), (16, 4, 400)] {
            let b = ws.step(rows, out, logits).unwrap();
            assert_eq!(b.hidden.len(), rows * 64);
            assert_eq!(b.qkv.len(), rows * (64 + 2 * 32));
            assert_eq!(b.gate_up.len(), rows * 320);
            assert_eq!(b.selected.len(), out * 64);
            assert_eq!(b.logits.len(), logits);
            assert!(b.normed.iter().chain(b.logits.iter()).all(|&x| x == 0.0));
            b.hidden.fill(1.0); // dirty it: the next step must hand out zeros again
            let used = ws.stats().pool_stats.used_bytes;
            assert_eq!(used, plan.step_bytes(rows, out, logits));
        }
        let st = ws.stats();
        assert_eq!((st.resizes, st.steps), (0, 4));
        assert_eq!(
            st.pool_stats.system_allocations, 1,
            "one region, never grown"
        );
    }

    #[test]
    fn a_step_beyond_the_plan_resizes_the_arena_once() {
        let plan = WorkspacePlan::new(&config(), 4, 1);
        let mut ws =
            ForwardWorkspace::new(MemoryPoolKind::Arena, plan, PoolFaultSwitch::default()).unwrap();
        let need = plan.step_bytes(64, 8, 800);
        assert!(need > plan.peak_bytes());
        for _ in 0..3 {
            let b = ws.step(64, 8, 800).unwrap();
            assert_eq!(b.gate_up.len(), 64 * 320);
        }
        let st = ws.stats();
        assert_eq!(st.resizes, 1);
        assert_eq!(st.pool_stats.capacity_bytes, need);
        assert_eq!(st.pool_stats.system_allocations, 2);
        // Smaller steps fit the grown region.
        ws.step(4, 1, 100).unwrap();
        assert_eq!(ws.stats().resizes, 1);
    }

    #[test]
    fn slab_and_system_pools_serve_the_same_steps() {
        let plan = WorkspacePlan::new(&config(), 16, 4);
        for kind in [MemoryPoolKind::Slab, MemoryPoolKind::System] {
            let mut ws = ForwardWorkspace::new(kind, plan, PoolFaultSwitch::default()).unwrap();
            for rows in [16, 1, 32] {
                let b = ws.step(rows, 2, 200).unwrap();
                assert_eq!(b.act.len(), rows * 160);
                assert!(b.act.iter().all(|&x| x == 0.0));
                b.act.fill(2.0);
            }
            let st = ws.stats();
            assert_eq!((st.pool, st.resizes, st.steps), (kind, 0, 3));
            assert_eq!(st.planned_bytes, plan.peak_bytes());
        }
    }

    #[test]
    fn an_armed_fault_fails_one_step_inside_each_pool_and_the_next_step_works() {
        let plan = WorkspacePlan::new(&config(), 16, 4);
        let kinds = [
            MemoryPoolKind::Arena,
            MemoryPoolKind::Slab,
            MemoryPoolKind::System,
        ];
        for kind in kinds {
            let fault = PoolFaultSwitch::default();
            let mut ws = ForwardWorkspace::new(kind, plan, fault.clone()).unwrap();
            fault.arm();
            let err = ws.step(4, 1, 0).err().expect("the armed step fails");
            assert_eq!(err.kind, crate::ErrorKind::OutOfMemory, "{kind:?}: {err}");
            let b = ws.step(4, 1, 0).unwrap();
            assert!(b.act.iter().all(|&x| x == 0.0), "{kind:?}");
        }
    }
}
