//! Choosing what runs in a step, and preemption (recompute or swap).

use super::{PreemptionMode, Session};
use crate::engine::request::{Event, FinishReason, RequestId};
use crate::kv::KvCacheBackend;
use crate::memory::try_with_capacity;
use crate::model::ForwardContext;
use crate::Result;

/// Fewest tokens a deferred admission must expect to gain from a prefix
/// that another request is computing; below that, starting now is cheaper
/// than waiting a step.
const MIN_DEFER_GAIN: usize = 32;

/// What `admit` decided for a waiting request.
enum Admission {
    /// Started: compute this many rows this step.
    Start(usize),
    /// Left waiting: a running request is computing its prefix right now.
    Defer,
    /// Left waiting: no KV room. Head of line: admission stops here.
    NoRoom,
}

impl Session {
    pub(super) fn rank(&self, id: RequestId) -> (i64, u64) {
        self.policy.rank(&self.requests[&id].rank, self.stats.steps)
    }

    /// Fills `scratch.plan` with (request, rows) under the token budget and
    /// the sequence cap: running requests first, in rank order (preempting
    /// the least urgent when KV runs out), then waiting requests in rank
    /// order while KV allows (head of line: the first one that does not fit
    /// stops admission, so a large urgent request is not starved by small
    /// later ones). A waiting request whose prompt prefix a running request
    /// is computing right now is passed over until that prefix is cached.
    pub(super) fn schedule(&mut self, events: &mut Vec<Event>) {
        let mut plan = std::mem::take(&mut self.scratch.plan);
        plan.clear();
        let mut budget = self.params.max_batched_tokens;
        let chunk = self.params.prefill_chunk_size;
        let preemptions_before = self.stats.preemptions;
        self.propose_drafts();

        // Ranks are unique (they end with the arrival number), so an
        // unstable sort orders like a stable one, without a merge buffer.
        let mut order = std::mem::take(&mut self.scratch.order);
        order.clear();
        order.extend_from_slice(&self.running);
        order.sort_unstable_by_key(|&id| self.rank(id));
        for &id in &order {
            if budget == 0 || !self.running.contains(&id) {
                continue;
            }
            let req = &self.requests[&id];
            let n = (req.tokens.len() - req.computed).min(chunk).min(budget);
            if self.place_draft(id, n, budget) {
                let drafted = self.requests[&id].draft.len();
                plan.push((id, n));
                budget -= n + drafted;
                continue;
            }
            loop {
                let total = self.requests[&id].computed + n;
                if self.kv_allocate(id, total) {
                    plan.push((id, n));
                    budget -= n;
                    break;
                }
                let victim = self.pick_victim(&plan);
                self.preempt(victim);
                if victim == id {
                    break;
                }
            }
        }

        self.scratch.order = order;

        // A step that had to preempt admits nobody: the room it freed belongs
        // to the running requests, and a victim re-admitted at once would
        // only be preempted again.
        let preempted = self.stats.preemptions != preemptions_before;
        let mut waiting = std::mem::take(&mut self.waiting);
        waiting.sort_unstable_by_key(|&id| self.rank(id));
        self.waiting = waiting;
        let mut i = 0;
        while !preempted
            && budget > 0
            && self.running.len() < self.params.max_seqs
            && i < self.waiting.len()
        {
            let id = self.waiting[i];
            match self.admit(id, budget, chunk) {
                Admission::Start(n) => {
                    self.waiting.remove(i);
                    self.running.push(id);
                    plan.push((id, n));
                    budget -= n;
                }
                Admission::Defer => i += 1,
                Admission::NoRoom => break,
            }
        }
        if plan.is_empty() && self.running.is_empty() && !preempted {
            // Admission refuses requests that could never fit, so an empty
            // engine always admits its head; if it did not, fail the head
            // rather than spin forever.
            if let Some(&id) = self.waiting.first() {
                let need = self.requests[&id].tokens.len();
                let msg = format!(
                    "request needs {need} KV slots but an idle session with {} slots could not place it",
                    self.capacity_tokens
                );
                let event = self.new_event(id);
                self.finish(event, FinishReason::Error(msg), events);
            }
        }
        self.scratch.plan = plan;
    }

    /// Gives request `id`'s drafted tokens rows and KV after its `n` rows,
    /// within `budget`; true when they got them. Drafts never preempt: a
    /// draft that does not fit is dropped, and the request decodes plainly.
    fn place_draft(&mut self, id: RequestId, n: usize, budget: usize) -> bool {
        let req = self.requests.get_mut(&id).expect("running request exists");
        req.draft.truncate(budget.saturating_sub(n));
        if req.draft.is_empty() {
            return false;
        }
        let total = req.computed + n + req.draft.len();
        if self.kv_allocate(id, total) {
            return true;
        }
        self.requests.get_mut(&id).expect("exists").draft.clear();
        false
    }

    /// Tries to start waiting request `id`: attaches its cached prefix,
    /// allocates its first chunk and restores swapped KV. Unless it starts,
    /// it stays waiting and holds no KV.
    fn admit(&mut self, id: RequestId, budget: usize, chunk: usize) -> Admission {
        let req = self.requests.get_mut(&id).expect("waiting request exists");
        let cached = self.kv.begin(id, &req.tokens, req.params.cache_salt);
        // Size the request's KV tables for its whole life: decoding then
        // never grows them.
        self.kv
            .reserve(id, req.prompt_len + req.params.sampling.max_tokens as usize);
        let swapped = req.swapped.as_ref().map_or(0, |(n, _)| *n);
        let resume_to = swapped.max(cached);
        if self.params.prefix_caching && self.prefix_in_flight(id, resume_to) {
            self.kv.release(id);
            return Admission::Defer;
        }
        let n = (self.requests[&id].tokens.len() - resume_to)
            .min(chunk)
            .min(budget);
        if n == 0 || !self.kv_allocate(id, resume_to + n) {
            self.kv.release(id);
            return Admission::NoRoom;
        }
        let req = self.requests.get_mut(&id).expect("waiting request exists");
        req.in_kv = true;
        req.computed = cached;
        // Only the first admission's hit is the request's cached prompt: a
        // resumed request finds (or restores) KV it computed itself. A
        // restored conversation's first admission counts its restored KV.
        req.cached_prompt_tokens.get_or_insert(resume_to);
        if cached > 0 {
            self.stats.prefix_hits += 1;
            self.stats.prefix_cached_tokens += cached as u64;
        }
        self.swap_in(id);
        Admission::Start(n)
    }

    /// In-batch prefix sharing (as SGLang does): true when a running request
    /// of the same cache salt is still computing a prompt that shares at
    /// least `MIN_DEFER_GAIN` more tokens with waiting request `id` than
    /// `id` has ready (`have`). Starting `id` now would compute those tokens
    /// a second time; a step or two later they come from the prefix cache.
    fn prefix_in_flight(&self, id: RequestId, have: usize) -> bool {
        let w = &self.requests[&id];
        let granularity = self.kv.stats().granularity.max(1);
        // `begin` leaves the last prompt token to compute.
        let reusable = w.tokens.len() - 1;
        if reusable < have + MIN_DEFER_GAIN {
            return false;
        }
        self.running.iter().any(|r| {
            let r = &self.requests[r];
            if r.params.cache_salt != w.params.cache_salt || r.computed >= r.prompt_len {
                return false;
            }
            let shared = r.tokens[..r.prompt_len]
                .iter()
                .zip(&w.tokens[..reusable])
                .take_while(|(a, b)| a == b)
                .count();
            shared / granularity * granularity >= have + MIN_DEFER_GAIN
        })
    }

    /// The least urgent running request not yet planned this step. Requests
    /// are planned in rank order, so this is never more urgent than the one
    /// asking for room (and may be that one itself).
    fn pick_victim(&self, plan: &[(RequestId, usize)]) -> RequestId {
        self.running
            .iter()
            .copied()
            .filter(|id| !plan.iter().any(|(p, _)| p == id))
            .max_by_key(|&id| self.rank(id))
            .expect("the request being scheduled is itself a candidate")
    }

    /// Moves running request `id` back to the waiting queue, freeing its KV
    /// (after saving it to host memory in swap mode).
    fn preempt(&mut self, id: RequestId) {
        self.stats.preemptions += 1;
        self.running.retain(|&r| r != id);
        let computed = self.requests[&id].computed;
        if self.params.preemption == PreemptionMode::Swap && computed > 0 {
            // On failure the KV is recomputed instead: slower, never wrong.
            if let Ok(saved) = self.swap_out(id, computed) {
                self.stats.swapped_out_tokens += computed as u64;
                let req = self.requests.get_mut(&id).expect("running request exists");
                req.swapped = Some((computed, saved));
            }
        }
        self.kv.release(id);
        self.release_draft(id);
        let req = self.requests.get_mut(&id).expect("running request exists");
        req.in_kv = false;
        req.computed = 0;
        req.draft.clear();
        self.waiting.push(id);
    }

    /// Copies the KV of positions `0..n` of running request `id` to host
    /// memory. A host that cannot hold it is an error, not an abort.
    fn swap_out(&mut self, id: RequestId, n: usize) -> Result<Vec<f32>> {
        let step = self.stats.steps;
        if let Some(e) = self.faults.as_mut().and_then(|f| f.swap_out_error(step)) {
            // A copy that broke off midway.
            kv_to_host(self.kv.as_ref(), self.ctx.as_mut(), id, n / 2)?;
            return Err(e);
        }
        kv_to_host(self.kv.as_ref(), self.ctx.as_mut(), id, n)
    }

    /// Restores swapped KV after `allocate` gave the request room again.
    /// Positions the prefix cache already supplied (`0..computed`) are not
    /// rewritten: they may be shared with other sequences.
    fn swap_in(&mut self, id: RequestId) {
        let req = self.requests.get_mut(&id).expect("exists");
        let Some((n, data)) = req.swapped.take() else {
            return;
        };
        let from = req.computed;
        if n <= from {
            return;
        }
        let per_slot = self.ctx.kv_values_per_slot();
        let mapping = self.kv.mapping(id);
        let slots: Vec<u32> = (from..n).map(|p| mapping.slot(p) as u32).collect();
        if self
            .restore_kv(&slots, &data[from * per_slot..n * per_slot])
            .is_err()
        {
            // The positions are recomputed instead (which overwrites
            // whatever the failed copy left in their slots).
            return;
        }
        self.stats.swapped_in_tokens += (n - from) as u64;
        let req = self.requests.get_mut(&id).expect("exists");
        req.computed = n;
        self.kv.commit(id, &req.tokens[..n]);
    }

    /// `ctx.restore_kv`, unless an injected fault makes it break off midway.
    fn restore_kv(&mut self, slots: &[u32], data: &[f32]) -> Result<()> {
        let step = self.stats.steps;
        if let Some(e) = self.faults.as_mut().and_then(|f| f.swap_in_error(step)) {
            let half = slots.len() / 2;
            let garbage = vec![f32::NAN; half * self.ctx.kv_values_per_slot()];
            self.ctx.restore_kv(&slots[..half], &garbage)?;
            return Err(e);
        }
        self.ctx.restore_kv(slots, data)
    }
}

/// Copies the KV of positions `0..n` of sequence `id` to host memory. A
/// host that cannot hold it is an error, not an abort.
pub(super) fn kv_to_host(
    kv: &dyn KvCacheBackend,
    ctx: &mut dyn ForwardContext,
    id: RequestId,
    n: usize,
) -> Result<Vec<f32>> {
    let mapping = kv.mapping(id);
    let slots: Vec<u32> = (0..n).map(|p| mapping.slot(p) as u32).collect();
    let values = n.saturating_mul(ctx.kv_values_per_slot());
    let mut saved = try_with_capacity(values, "the host copy of a request's KV")?;
    ctx.save_kv(&slots, &mut saved)?;
    Ok(saved)
}
