//! Overlapped steps: a decode step's successor is launched before the
//! step's ids reach the host, the device feeding them in as its tokens, so
//! a GPU runs it while the host reports the step before it instead of
//! idling between the two (issue 9: input preparation overlapped with the
//! previous step).
//!
//! Only a steady decode chains: nothing waits for admission, the launched
//! step holds every running request, each of its rows chooses its token on
//! the device (greedy, or sampled without logprobs) and none is due to stop
//! by length. A sampled row draws its uniform when it is launched, so the
//! request's random stream is drawn in the same order; its penalties count
//! the token the device feeds in as one more output token
//! (`RowSampling::pending`). A chained row whose request ends before
//! it lands (an EOS, a stop string, a cancel) is computed and dropped. Its
//! KV write lands past the request's committed tokens, in a slot that is
//! then freed unhashed, and whoever gets the slot next writes it in a later
//! step, which the device runs after this one.

use super::output::relabel;
use super::{Session, TokensFrom};
use crate::engine::request::{Event, RequestId};
use crate::forward::AttnSeq;
use crate::model::ForwardBatch;
use crate::Error;
use std::time::Instant;

/// (request, rows) in batch order.
type Plan = Vec<(RequestId, usize)>;

/// A launched step whose ids have not been collected.
pub(super) struct InFlight {
    plan: Plan,
    /// Ids it returns: one per entry that samples.
    rows: usize,
    /// Launched behind another step: requests may have ended since.
    chained: bool,
}

impl Session {
    /// The step `run_forward` has just launched.
    pub(super) fn launched(&mut self) -> InFlight {
        let plan = std::mem::take(&mut self.scratch.plan);
        InFlight {
            rows: self.scratch.logits_rows.len(),
            plan,
            chained: false,
        }
    }

    /// Launches the step after `flight` when it can, then lands `flight`.
    pub(super) fn advance(&mut self, flight: InFlight, events: &mut Vec<Event>) {
        let next = self.launch_chained(&flight.plan);
        self.land(flight, events);
        match next {
            Some(Ok(next)) => self.in_flight = Some(next),
            Some(Err((plan, e))) => {
                let spare = std::mem::replace(&mut self.scratch.plan, plan);
                self.fail_scheduled(&e, events);
                self.scratch.spare_plan = spare;
            }
            None => {}
        }
    }

    /// Whether the step after the launched `plan` is known before its ids
    /// are: every running request decodes one more token, chosen on the
    /// device.
    fn can_chain(&self, plan: &[(RequestId, usize)]) -> bool {
        let max_positions = self.model.config().max_position_embeddings;
        let device_samples = self.scratch.allow_device_sampling && self.ctx.samples_on_device();
        self.overlap
            && self.waiting.is_empty()
            && !self.speculation_due()
            && plan.len() == self.running.len()
            && plan.iter().all(|&(id, n)| {
                let Some(r) = self.requests.get(&id) else {
                    return false;
                };
                // Once the launched step's id is appended.
                let tokens = r.tokens.len() + 1;
                let generated = tokens - r.prompt_len;
                let s = &r.params.sampling;
                // A grammar's next mask needs the launched step's token.
                r.computed + n == r.tokens.len()
                    && (r.sampler.is_plain_greedy()
                        || (device_samples
                            && r.sampler.samples_on_device()
                            && !r.sampler.has_grammar()))
                    && generated >= s.min_tokens as usize
                    && generated < s.max_tokens as usize
                    && tokens < max_positions
            })
    }

    /// Launches one decode row per entry of the launched `plan`, its token
    /// the id that step chooses. `None` when it cannot chain (or the KV
    /// for the new row is not there); the plan with the error when the
    /// launch fails.
    fn launch_chained(
        &mut self,
        plan: &[(RequestId, usize)],
    ) -> Option<Result<InFlight, (Plan, Error)>> {
        if !self.can_chain(plan) {
            return None;
        }
        for &(id, _) in plan {
            // The new row's position is the launched step's token count.
            let total = self.requests[&id].tokens.len() + 1;
            if !self.kv_allocate(id, total) {
                return None;
            }
        }
        let vocab = self.model.config().vocab_size;
        let Session {
            kv,
            ctx,
            requests,
            scratch,
            stats,
            ..
        } = self;
        let greedy = plan
            .iter()
            .all(|(id, _)| requests[id].sampler.is_plain_greedy());
        if !greedy {
            scratch.device_sampling.clear();
            for &(id, _) in plan {
                let req = requests.get_mut(&id).expect("chained request exists");
                // The draw below belongs to a token not yet reported: a
                // state saved meanwhile resumes from before it.
                req.flight_rng = Some(req.sampler.rng_state());
                let (prompt, output) = req.tokens.split_at(req.history_start);
                // Nothing suppressed: `can_chain` saw min_tokens reached.
                let rows = &mut scratch.device_sampling;
                req.sampler
                    .push_device_row(vocab, prompt, output, &[], rows);
                // The penalties' lists lack the launched step's token.
                req.sampler.mark_pending(rows);
            }
        }
        scratch.tokens.clear();
        scratch.logits_rows.clear();
        let mut next = std::mem::take(&mut scratch.spare_plan);
        next.clear();
        let mut seqs = relabel(std::mem::take(&mut scratch.seqs));
        for (row, &(id, n)) in plan.iter().enumerate() {
            // Placeholder: the device feeds the launched step's id.
            scratch.tokens.push(0);
            scratch.logits_rows.push(row);
            seqs.push(AttnSeq {
                start: row,
                len: 1,
                context_len: requests[&id].computed + n,
                kv: kv.mapping(id),
            });
            next.push((id, 1));
        }
        let batch = ForwardBatch {
            tokens: &scratch.tokens,
            seqs: &seqs,
            logits_rows: &scratch.logits_rows,
            stop: None,
        };
        let started = Instant::now();
        let sampling = (!greedy).then_some(&scratch.device_sampling);
        let result = ctx.launch(&batch, sampling, true);
        stats.forward_time_ns += started.elapsed().as_nanos() as u64;
        seqs.clear();
        scratch.seqs = relabel(seqs);
        Some(match result {
            Ok(()) => {
                stats.chained_steps += 1;
                Ok(InFlight {
                    rows: next.len(),
                    plan: next,
                    chained: true,
                })
            }
            Err(e) => Err((next, e)),
        })
    }

    /// Collects `flight`'s ids and reports its step (`finish_step`), less
    /// the rows of requests that ended after a chained launch.
    fn land(&mut self, flight: InFlight, events: &mut Vec<Event>) {
        let InFlight {
            mut plan,
            rows,
            chained,
        } = flight;
        let ids = &mut self.scratch.device_tokens;
        ids.clear();
        ids.resize(rows, 0);
        let started = Instant::now();
        let result = self.ctx.collect_ids(ids);
        self.stats.forward_time_ns += started.elapsed().as_nanos() as u64;
        for (id, _) in &plan {
            if let Some(r) = self.requests.get_mut(id) {
                r.flight_rng = None;
            }
        }
        if chained {
            // One row per entry.
            let mut kept = 0;
            for i in 0..plan.len() {
                if self.requests.contains_key(&plan[i].0) {
                    plan[kept] = plan[i];
                    ids[kept] = ids[i];
                    kept += 1;
                }
            }
            plan.truncate(kept);
            ids.truncate(kept);
        }
        let spare = std::mem::replace(&mut self.scratch.plan, plan);
        self.scratch.tokens_from = TokensFrom::DeviceArgmax;
        match result {
            Ok(()) => self.finish_step(events),
            Err(e) => self.fail_scheduled(&e, events),
        }
        self.scratch.spare_plan = spare;
    }
}
