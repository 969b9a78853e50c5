//! The session's side of speculative decoding: asking the proposer for
//! drafts before a step, and keeping the drafted tokens the target's own
//! sampling agrees with after it (see `engine::speculative`).

use super::{Request, Session, TokensFrom};
use crate::engine::model::Model;
use crate::engine::request::{Event, FinishReason, RequestId};
use crate::engine::speculative::draft::DraftContext;
use crate::engine::speculative::{create_proposer, Ask, Proposer, SpeculativeParams};
use crate::kv::{create_kv_backend, KvBackendKind};
use crate::model::ContextShape;
use crate::Result;
use std::sync::Arc;

/// A session's speculative decoding.
pub(super) struct Speculation {
    proposer: Box<dyn Proposer>,
    max_k: usize,
    max_batch: usize,
    /// The proposer keeps a model's KV of the prompts (`warm_drafts`).
    needs_prompts: bool,
    /// Scratch: (request, k) of this step's asks and their drafts.
    asks: Vec<(RequestId, usize)>,
    drafts: Vec<Vec<u32>>,
}

impl Speculation {
    /// `target_shape` is the target's context shape; a draft model gets a
    /// context of the same rows and a KV cache of `capacity_tokens`.
    pub(super) fn new(
        params: &SpeculativeParams,
        target: &Model,
        target_shape: &ContextShape,
        capacity_tokens: usize,
    ) -> Result<Self> {
        let proposer = create_proposer(params, target, |draft: &Arc<Model>| {
            let (kv, slots) = create_kv_backend(KvBackendKind::Token, capacity_tokens, 1, false);
            // The draft's own fault switch: injected pool failures are the
            // target context's.
            let shape = ContextShape {
                kv_slots: slots,
                pool_fault: Default::default(),
                ..target_shape.clone()
            };
            Ok(DraftContext {
                ctx: draft.decoder.clone().new_context(&shape)?,
                kv,
                max_rows: shape.max_rows,
                max_logits_rows: shape.max_logits_rows,
            })
        })?;
        let max_batch = params.effective_max_batch();
        Ok(Speculation {
            proposer,
            max_k: params.max_k(),
            max_batch,
            needs_prompts: params.draft_model().is_some(),
            asks: Vec::with_capacity(max_batch),
            drafts: vec![Vec::new(); max_batch],
        })
    }
}

impl Session {
    /// How many tokens running request `req` may draft this step (0: it
    /// does not speculate): it is decoding, did not opt out, the step has
    /// at most `max_batch` requests, and its output has room for the
    /// drafted tokens and the target's own.
    fn draft_room(&self, req: &Request, max_batch: usize) -> usize {
        let max_positions = self.model.config().max_position_embeddings;
        let limit = (req.prompt_len + req.params.sampling.max_tokens as usize).min(max_positions);
        let decoding = req.computed + 1 == req.tokens.len() && req.tokens.len() > req.prompt_len;
        if self.running.len() > max_batch || req.params.disable_speculation || !decoding {
            return 0;
        }
        limit.saturating_sub(req.tokens.len() + 1)
    }

    /// True when a running request would draft in the next step (a step
    /// that cannot be chained behind this one: its rows depend on the
    /// drafts).
    pub(super) fn speculation_due(&self) -> bool {
        let Some(spec) = self.spec.as_ref() else {
            return false;
        };
        self.running.iter().any(|id| {
            self.requests
                .get(id)
                .is_some_and(|r| self.draft_room(r, spec.max_batch) > 0)
        })
    }

    /// Fills the drafts of this step's speculating requests (and empties
    /// every other running request's).
    pub(super) fn propose_drafts(&mut self) {
        let Some(mut spec) = self.spec.take() else {
            return;
        };
        spec.asks.clear();
        for &id in &self.running {
            let room = self.draft_room(&self.requests[&id], spec.max_batch);
            if room > 0 {
                spec.asks.push((id, spec.max_k.min(room)));
            }
        }
        // A step that did not run (a cancel or an abort stopped it) leaves
        // its drafts behind; they are stale now.
        for id in &self.running {
            self.requests
                .get_mut(id)
                .expect("running request exists")
                .draft
                .clear();
        }
        for (id, max_k) in spec.asks.iter_mut() {
            let req = self.requests.get_mut(id).expect("running request exists");
            *max_k = req.spec.next_k(*max_k);
        }
        spec.asks.retain(|&(_, k)| k > 0);
        let asks: Vec<Ask<'_>> = spec
            .asks
            .iter()
            .map(|&(id, k)| Ask {
                id,
                tokens: &self.requests[&id].tokens,
                k,
            })
            .collect();
        let drafts = &mut spec.drafts[..asks.len()];
        drafts.iter_mut().for_each(Vec::clear);
        spec.proposer.propose(&asks, drafts);
        drop(asks);
        for (&(id, k), draft) in spec.asks.iter().zip(spec.drafts.iter_mut()) {
            let req = self.requests.get_mut(&id).expect("running request exists");
            draft.truncate(k);
            std::mem::swap(&mut req.draft, draft);
        }
        self.spec = Some(spec);
    }

    /// Lets a draft model compute the prompt chunks this step's plan
    /// computes for the target, for requests that will speculate, so that
    /// their first drafts wait for nothing (the cost goes with the prompt,
    /// as the target's does). Only in steps small enough to speculate.
    pub(super) fn warm_drafts(&mut self) {
        let Some(mut spec) = self.spec.take() else {
            return;
        };
        if spec.needs_prompts && self.running.len() <= spec.max_batch {
            let mut asks = Vec::new();
            for &(id, n) in &self.scratch.plan {
                let req = &self.requests[&id];
                if req.params.disable_speculation || req.computed + n > req.prompt_len {
                    continue;
                }
                asks.push(Ask {
                    id,
                    tokens: &req.tokens[..req.computed + n],
                    k: 0,
                });
            }
            if !asks.is_empty() {
                let mut none = vec![Vec::new(); asks.len()];
                spec.proposer.propose(&asks, &mut none);
            }
        }
        self.spec = Some(spec);
    }

    /// Frees what the proposer holds for request `id`.
    pub(super) fn release_draft(&mut self, id: RequestId) {
        if let Some(spec) = self.spec.as_mut() {
            spec.proposer.release(id);
        }
    }

    /// TESTING ONLY: KV slots the draft model holds.
    #[doc(hidden)]
    pub fn draft_kv_used_slots(&self) -> usize {
        self.spec.as_ref().map_or(0, |s| s.proposer.kv_used_slots())
    }

    /// Samples request `id`'s rows `first_row..=first_row + k` (its last
    /// known token, then its `k` drafted tokens) one after another, as
    /// decoding would, keeping each drafted token the sampling agrees with;
    /// the first disagreement (or the row after the last draft) gives the
    /// target's own token. Rolls the KV back to the kept tokens.
    pub(super) fn verify_drafts(
        &mut self,
        id: RequestId,
        first_row: usize,
        logits: &mut [f32],
        events: &mut Vec<Event>,
    ) {
        let vocab = self.model.config().vocab_size;
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        let draft = std::mem::take(&mut req.draft);
        let mut event = self.new_event(id);
        let mut accepted = 0;
        let mut ended = None;
        for (i, row) in (first_row..=first_row + draft.len()).enumerate() {
            let sampled = match self.scratch.tokens_from {
                TokensFrom::HostSampler => {
                    self.sample(id, &mut logits[row * vocab..(row + 1) * vocab])
                }
                _ => self.device_sampled(id, row),
            };
            self.count_masks(id);
            let sampled = match sampled {
                Ok(s) => s,
                Err(e) => {
                    ended = Some(FinishReason::Error(e.message));
                    break;
                }
            };
            let token = sampled.token;
            ended = self.push_token(id, sampled, &mut event);
            if ended.is_some() || draft.get(i) != Some(&token) {
                break;
            }
            accepted += 1;
        }
        self.stats.spec_draft_tokens += draft.len() as u64;
        self.stats.spec_accepted_tokens += accepted as u64;
        self.stats.spec_verifications += 1;
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        req.spec.record(draft.len(), accepted);
        req.computed += accepted;
        let mut draft = draft;
        draft.clear();
        req.draft = draft;
        match ended {
            Some(reason) => self.finish(event, reason, events),
            None => {
                let req = &self.requests[&id];
                self.kv.commit(id, &req.tokens[..req.computed]);
                self.kv.truncate(id, req.computed);
                events.push(event);
            }
        }
    }
}
