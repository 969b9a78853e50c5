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

use super::ModelConfig;
use crate::memory::{MemoryPoolKind, PoolStats, Workspace, WORKSPACE_ALIGN};
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
    pub fn new(c: &ModelConfig, max_rows: usize, max_logits_rows: usize) -> Self {
        let hd = c.head_dim;
        let (nq, nkv) = (c.num_heads * hd, c.num_kv_heads * hd);
        WorkspacePlan {
            d: c.hidden_size,
            qkv: nq + 2 * nkv,
            nq,
            inter: c.intermediate_size,
            half: hd / 2,
            vocab: c.vocab_size,
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

/// Usage figures of a context's workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceStats {
    pub pool: MemoryPoolKind,
    /// The planned peak in bytes.
    pub planned_bytes: usize,
    /// The pool's figures (capacity, peak, system allocations).
    pub pool_stats: PoolStats,
    /// Explicit arena resizes (steps larger than planned).
    pub resizes: u64,
    pub steps: u64,
    /// Time spent acquiring (and zeroing) step buffers, in nanoseconds.
    pub acquire_ns: u64,
}

/// A context's step workspace: the plan and the pool it draws from.
pub struct ForwardWorkspace {
    ws: Workspace,
    plan: WorkspacePlan,
    kind: MemoryPoolKind,
    resizes: u64,
    steps: u64,
    acquire_ns: u64,
}

impl ForwardWorkspace {
    /// A workspace over a new pool of `kind`; an arena is allocated at the
    /// plan's peak at once.
    pub fn new(kind: MemoryPoolKind, plan: WorkspacePlan) -> Result<Self> {
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
        let buffers = StepBuffers {
            hidden: ws.alloc_zeroed(hidden)?,
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
