//! A serving session: continuous batching over one model and one KV cache.
//!
//! Every `step` schedules work under a token budget (running requests first,
//! one decode token or one prefill chunk each, then waiting requests by
//! policy), runs one forward pass over the mixed batch, samples the rows that
//! completed their known tokens, and reports per-request events. Running out
//! of KV room preempts the least urgent running request (recompute or swap);
//! it never fails a request.

use super::model::Model;
use super::policy::{create_policy, RankInput, SchedulePolicy, SchedulePolicyKind};
use super::request::{Event, FinishReason, RequestId, RequestParams, TokenLogprob};
use crate::backend::cpu::attention::AttnSeq;
use crate::kv::{create_kv_backend, KvBackendKind, KvCacheBackend, KvStats, KvStorage};
use crate::model::{ForwardBatch, Workspace};
use crate::sampling::{Rng, Sampler, StopMatcher};
use crate::tokenizer::StreamDetokenizer;
use crate::{bail_arg, Error, ErrorKind, Result};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free the victim's KV and recompute it when it is resumed.
    Recompute,
    /// Copy the victim's KV to host memory and back when it is resumed.
    Swap,
}

impl std::str::FromStr for PreemptionMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "recompute" => PreemptionMode::Recompute,
            "swap" => PreemptionMode::Swap,
            _ => bail_arg!("preemption mode `{s}` is not supported (supported: recompute, swap)"),
        })
    }
}

#[derive(Debug, Clone)]
pub struct SessionParams {
    pub kv_backend: KvBackendKind,
    /// Tokens per block (paged backend).
    pub block_size: usize,
    /// KV capacity in tokens; 0 = derive from `kv_memory_bytes`.
    pub kv_capacity_tokens: usize,
    /// KV budget in bytes when `kv_capacity_tokens` is 0; 0 = automatic.
    pub kv_memory_bytes: usize,
    /// Token budget of one step (prefill chunks + decode tokens).
    pub max_batched_tokens: usize,
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Longest prefill piece of one request in one step.
    pub prefill_chunk_size: usize,
    pub policy: SchedulePolicyKind,
    /// Steps a waiting request needs to gain one priority level.
    pub aging_steps: u64,
    pub prefix_caching: bool,
    pub preemption: PreemptionMode,
    /// Seeds the session RNG that unseeded requests draw from.
    pub seed: u64,
}

impl Default for SessionParams {
    fn default() -> Self {
        SessionParams {
            kv_backend: KvBackendKind::Paged,
            block_size: 16,
            kv_capacity_tokens: 0,
            kv_memory_bytes: 0,
            max_batched_tokens: 512,
            max_seqs: 64,
            prefill_chunk_size: 512,
            policy: SchedulePolicyKind::Fcfs,
            aging_steps: 64,
            prefix_caching: true,
            preemption: PreemptionMode::Recompute,
            seed: 0,
        }
    }
}

/// Counters and occupancy for monitoring and tests.
#[derive(Debug, Clone, Default)]
pub struct SessionStats {
    pub running: usize,
    pub waiting: usize,
    pub kv: KvStats,
    pub kv_capacity_tokens: usize,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub preemptions: u64,
    pub swapped_out_tokens: u64,
}

struct Request {
    params: RequestParams,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// True between `kv.begin` and `kv.release`.
    in_kv: bool,
    /// KV of positions `0..swapped_tokens` saved by a swap preemption.
    swapped: Option<(usize, Vec<f32>)>,
    sampler: Sampler,
    detok: Option<StreamDetokenizer>,
    stop: StopMatcher,
    rank: RankInput,
}

pub struct Session {
    model: Arc<Model>,
    params: SessionParams,
    kv: Box<dyn KvCacheBackend>,
    storage: KvStorage,
    capacity_tokens: usize,
    ws: Workspace,
    logits: Vec<f32>,
    policy: Box<dyn SchedulePolicy>,
    requests: HashMap<RequestId, Request>,
    waiting: Vec<RequestId>,
    running: Vec<RequestId>,
    /// Terminal events of requests cancelled between steps.
    pending: Vec<Event>,
    rng: Rng,
    next_id: RequestId,
    next_arrival: u64,
    stats: SessionStats,
    /// Scratch reused across steps.
    scratch: StepScratch,
}

#[derive(Default)]
struct StepScratch {
    plan: Vec<(RequestId, usize)>,
    tokens: Vec<u32>,
    logits_rows: Vec<usize>,
    suppress: Vec<u32>,
}

/// Tokens that may not be sampled yet: EOS and stop ids before `min_tokens`.
fn suppressed_tokens(
    s: &crate::sampling::SamplingParams,
    eos: &[u32],
    generated: usize,
    out: &mut Vec<u32>,
) {
    out.clear();
    if generated < s.min_tokens as usize {
        if !s.ignore_eos {
            out.extend_from_slice(eos);
        }
        out.extend_from_slice(&s.stop_token_ids);
    }
}

/// Default KV budget when none is given: a quarter of available memory, at most 2 GiB.
fn default_kv_budget() -> usize {
    let available = crate::sysinfo::available_memory_bytes().unwrap_or(4 << 30);
    (available / 4).min(2 << 30)
}

impl Session {
    pub fn new(model: Arc<Model>, params: SessionParams) -> Result<Session> {
        let c = model.config();
        if params.max_batched_tokens == 0 || params.max_seqs == 0 || params.prefill_chunk_size == 0
        {
            bail_arg!("max_batched_tokens, max_seqs and prefill_chunk_size must be positive");
        }
        if params.block_size == 0 || params.block_size > 1024 {
            bail_arg!("block_size must be in 1..=1024, got {}", params.block_size);
        }
        let per_token = KvStorage::bytes_per_slot(c.num_layers, c.num_kv_heads, c.head_dim);
        let capacity_tokens = if params.kv_capacity_tokens > 0 {
            params.kv_capacity_tokens
        } else {
            let budget = if params.kv_memory_bytes > 0 {
                params.kv_memory_bytes
            } else {
                default_kv_budget()
            };
            let tokens = budget / per_token;
            if tokens < c.max_position_embeddings.min(4096) {
                return Err(Error::new(
                    ErrorKind::OutOfMemory,
                    format!(
                        "KV budget of {budget} bytes holds {tokens} tokens ({per_token} bytes each), less than one \
                         context of {} tokens; raise kv_memory_bytes or set kv_capacity_tokens",
                        c.max_position_embeddings.min(4096)
                    ),
                ));
            }
            tokens
        };
        let (kv, slots) = create_kv_backend(
            params.kv_backend,
            capacity_tokens,
            params.block_size,
            params.prefix_caching,
        );
        let storage = KvStorage::new(c.num_layers, slots, c.num_kv_heads, c.head_dim);
        let logits = vec![0.0; params.max_seqs * c.vocab_size];
        Ok(Session {
            policy: create_policy(params.policy, params.aging_steps),
            rng: Rng::seed_from_u64(params.seed),
            kv,
            storage,
            capacity_tokens,
            ws: Workspace::default(),
            logits,
            requests: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            pending: Vec::new(),
            next_id: 1,
            next_arrival: 0,
            stats: SessionStats::default(),
            scratch: StepScratch::default(),
            model,
            params,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Validates and queues a request; returns its id. Nothing is queued on error.
    pub fn add_request(&mut self, params: RequestParams) -> Result<RequestId> {
        let c = self.model.config();
        let vocab = c.vocab_size;
        if params.prompt.is_empty() {
            bail_arg!("prompt is empty");
        }
        if let Some(&bad) = params.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail_arg!("prompt token id {bad} is outside the vocabulary (size {vocab})");
        }
        params.sampling.validate(vocab)?;
        if !params.sampling.stop_strings.is_empty() && self.model.tokenizer.is_none() {
            bail_arg!("stop strings need a tokenizer, and this model has none");
        }
        let need = params.prompt.len() + params.sampling.max_tokens as usize;
        if need > c.max_position_embeddings {
            bail_arg!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's context length {}",
                params.prompt.len(),
                params.sampling.max_tokens,
                c.max_position_embeddings
            );
        }
        if need > self.capacity_tokens {
            bail_arg!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the session's KV capacity of {} tokens",
                params.prompt.len(),
                params.sampling.max_tokens,
                self.capacity_tokens
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        let fallback_seed = self.rng.next_u64();
        let detok = self
            .model
            .tokenizer
            .as_ref()
            .map(|_| StreamDetokenizer::new(true));
        let req = Request {
            sampler: Sampler::new(&params.sampling, fallback_seed),
            stop: StopMatcher::new(&params.sampling.stop_strings),
            detok,
            tokens: params.prompt.clone(),
            prompt_len: params.prompt.len(),
            computed: 0,
            in_kv: false,
            swapped: None,
            rank: RankInput {
                priority: params.priority,
                arrival: self.next_arrival,
                arrival_step: self.stats.steps,
            },
            params,
        };
        self.next_arrival += 1;
        self.requests.insert(id, req);
        self.waiting.push(id);
        Ok(id)
    }

    /// Cancels a waiting or running request. Its terminal event (reason
    /// `Cancelled`) is reported by the next `step`.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        let Some(req) = self.requests.remove(&id) else {
            bail_arg!("request {id} is not active (unknown, finished or already cancelled)");
        };
        self.waiting.retain(|&r| r != id);
        self.running.retain(|&r| r != id);
        if req.in_kv {
            self.kv.release(id);
        }
        self.pending.push(Event {
            request_id: id,
            tokens: vec![],
            text: String::new(),
            logprobs: vec![],
            finish: Some(FinishReason::Cancelled),
        });
        Ok(())
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.pending.is_empty()
    }

    pub fn stats(&self) -> SessionStats {
        let mut s = self.stats.clone();
        s.running = self.running.len();
        s.waiting = self.waiting.len();
        s.kv = self.kv.stats();
        s.kv_capacity_tokens = self.capacity_tokens;
        s
    }

    /// Checks the KV manager's invariants and, when idle, that every slot is
    /// free or evictable. Used by tests and debug builds.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.is_empty() && self.waiting.is_empty() {
            let s = self.kv.stats();
            if s.free_slots + s.evictable_slots != s.total_slots {
                return Err(format!("idle session leaks KV: {s:?}"));
            }
        }
        let tracked = self.running.len() + self.waiting.len();
        if tracked != self.requests.len() {
            return Err(format!(
                "{} requests tracked but {tracked} queued",
                self.requests.len()
            ));
        }
        Ok(())
    }

    /// Advances every scheduled request by one engine step and returns the
    /// events of this step (possibly none).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.pending);
        self.schedule();
        if !self.scratch.plan.is_empty() {
            if let Err(e) = self.run_forward() {
                self.fail_scheduled(&e, &mut events);
            } else {
                self.finish_step(&mut events);
            }
        }
        self.stats.steps += 1;
        if cfg!(debug_assertions) {
            if let Err(e) = self.check_invariants() {
                panic!("session invariant violated: {e}");
            }
        }
        Ok(events)
    }

    fn rank(&self, id: RequestId) -> (i64, u64) {
        self.policy.rank(&self.requests[&id].rank, self.stats.steps)
    }

    /// Fills `scratch.plan` with (request, new tokens) under the budgets.
    fn schedule(&mut self) {
        let mut plan = std::mem::take(&mut self.scratch.plan);
        plan.clear();
        let mut budget = self.params.max_batched_tokens;
        let chunk = self.params.prefill_chunk_size;

        let mut order = self.running.clone();
        order.sort_by_key(|&id| self.rank(id));
        for id in order {
            if budget == 0 || !self.running.contains(&id) {
                continue;
            }
            let req = &self.requests[&id];
            let n = (req.tokens.len() - req.computed).min(chunk).min(budget);
            loop {
                let total = self.requests[&id].computed + n;
                if self.kv.allocate(id, total) {
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

        let mut waiting = std::mem::take(&mut self.waiting);
        waiting.sort_by_key(|&id| self.rank(id));
        self.waiting = waiting;
        while budget > 0 && self.running.len() < self.params.max_seqs && !self.waiting.is_empty() {
            let id = self.waiting[0];
            let req = self.requests.get_mut(&id).expect("waiting request exists");
            if !req.in_kv {
                req.computed = self.kv.begin(id, &req.tokens, req.params.cache_salt);
                req.in_kv = true;
            }
            let req = &self.requests[&id];
            let resume_to = req
                .swapped
                .as_ref()
                .map_or(0, |(n, _)| *n)
                .max(req.computed);
            let n = (req.tokens.len() - resume_to).min(chunk).min(budget);
            if n == 0 || !self.kv.allocate(id, resume_to + n) {
                // Head-of-line: wait until running requests free room.
                let req = self.requests.get_mut(&id).expect("exists");
                self.kv.release(id);
                req.in_kv = false;
                req.computed = 0;
                break;
            }
            self.swap_in(id);
            self.waiting.remove(0);
            self.running.push(id);
            plan.push((id, n));
            budget -= n;
        }
        self.scratch.plan = plan;
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

    fn preempt(&mut self, id: RequestId) {
        self.stats.preemptions += 1;
        self.running.retain(|&r| r != id);
        let req = self.requests.get_mut(&id).expect("running request exists");
        if self.params.preemption == PreemptionMode::Swap && req.computed > 0 {
            let mapping = self.kv.mapping(id);
            let mut saved = Vec::with_capacity(
                req.computed * self.storage.slot_width() * 2 * self.storage.num_layers,
            );
            for p in 0..req.computed {
                self.storage.read_slot(mapping.slot(p), &mut saved);
            }
            self.stats.swapped_out_tokens += req.computed as u64;
            req.swapped = Some((req.computed, saved));
        }
        self.kv.release(id);
        req.in_kv = false;
        req.computed = 0;
        self.waiting.push(id);
    }

    /// Restores swapped KV after `allocate` gave the request room again.
    fn swap_in(&mut self, id: RequestId) {
        let req = self.requests.get_mut(&id).expect("exists");
        let Some((n, data)) = req.swapped.take() else {
            return;
        };
        let per_slot = self.storage.slot_width() * 2 * self.storage.num_layers;
        let mapping = self.kv.mapping(id);
        for p in req.computed..n {
            self.storage
                .write_slot(mapping.slot(p), &data[p * per_slot..(p + 1) * per_slot]);
        }
        req.computed = n;
        let tokens = req.tokens[..n].to_vec();
        self.kv.commit(id, &tokens);
    }

    fn run_forward(&mut self) -> Result<()> {
        let Session {
            model,
            kv,
            storage,
            ws,
            logits,
            requests,
            scratch,
            ..
        } = self;
        scratch.tokens.clear();
        scratch.logits_rows.clear();
        let mut seqs = Vec::with_capacity(scratch.plan.len());
        for &(id, n) in &scratch.plan {
            let req = &requests[&id];
            let start = scratch.tokens.len();
            scratch
                .tokens
                .extend_from_slice(&req.tokens[req.computed..req.computed + n]);
            if req.computed + n == req.tokens.len() {
                scratch.logits_rows.push(start + n - 1);
            }
            seqs.push(AttnSeq {
                start,
                len: n,
                context_len: req.computed,
                kv: kv.mapping(id),
            });
        }
        let batch = ForwardBatch {
            tokens: &scratch.tokens,
            seqs: &seqs,
            logits_rows: &scratch.logits_rows,
        };
        model
            .decoder
            .forward(&model.pool, &batch, storage, ws, logits)
    }

    fn fail_scheduled(&mut self, err: &Error, events: &mut Vec<Event>) {
        let plan = std::mem::take(&mut self.scratch.plan);
        for &(id, _) in &plan {
            self.finish(
                id,
                FinishReason::Error(err.message.clone()),
                vec![],
                String::new(),
                vec![],
                events,
            );
        }
        self.scratch.plan = plan;
    }

    fn finish_step(&mut self, events: &mut Vec<Event>) {
        let vocab = self.model.config().vocab_size;
        let plan = std::mem::take(&mut self.scratch.plan);
        let mut logits_row = 0;
        for &(id, n) in &plan {
            let req = self
                .requests
                .get_mut(&id)
                .expect("scheduled request exists");
            let was_prefill = req.computed < req.prompt_len;
            req.computed += n;
            if was_prefill {
                self.stats.prefill_tokens += n as u64;
            } else {
                self.stats.decode_tokens += n as u64;
            }
            let computed = req.computed;
            self.kv.commit(id, &self.requests[&id].tokens[..computed]);
            let req = self.requests.get_mut(&id).expect("exists");
            if req.computed < req.tokens.len() {
                continue; // a non-final prefill chunk: no logits, no event
            }
            let logits = &mut self.logits[logits_row * vocab..(logits_row + 1) * vocab];
            logits_row += 1;
            let suppress = &mut self.scratch.suppress;
            suppressed_tokens(
                &req.params.sampling,
                &self.model.eos_token_ids,
                req.tokens.len() - req.prompt_len,
                suppress,
            );
            let (prompt, output) = req.tokens.split_at(req.prompt_len);
            let sampled = match req.sampler.sample(logits, prompt, output, suppress) {
                Ok(s) => s,
                Err(e) => {
                    self.finish(
                        id,
                        FinishReason::Error(e.message),
                        vec![],
                        String::new(),
                        vec![],
                        events,
                    );
                    continue;
                }
            };
            req.tokens.push(sampled.token);
            let logprobs = if req.params.sampling.logprobs > 0 {
                vec![TokenLogprob {
                    token: sampled.token,
                    logprob: sampled.logprob,
                    top: sampled.top_logprobs,
                }]
            } else {
                vec![]
            };
            let mut text = String::new();
            let mut stop_hit = None;
            if let (Some(detok), Some(tok)) = (req.detok.as_mut(), self.model.tokenizer.as_ref()) {
                let delta = detok.push(tok, sampled.token).unwrap_or_default();
                let out = req.stop.push(&delta);
                text = out.text;
                stop_hit = out.stop;
            }
            let generated = req.tokens.len() - req.prompt_len;
            let s = &req.params.sampling;
            let reason = if let Some(i) = stop_hit {
                Some(FinishReason::StopString(i))
            } else if !s.ignore_eos && self.model.eos_token_ids.contains(&sampled.token) {
                Some(FinishReason::Eos)
            } else if s.stop_token_ids.contains(&sampled.token) {
                Some(FinishReason::StopToken(sampled.token))
            } else if generated >= s.max_tokens as usize
                || req.tokens.len() >= self.model.config().max_position_embeddings
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            match reason {
                Some(r) => self.finish(id, r, vec![sampled.token], text, logprobs, events),
                None => events.push(Event {
                    request_id: id,
                    tokens: vec![sampled.token],
                    text,
                    logprobs,
                    finish: None,
                }),
            }
        }
        self.scratch.plan = plan;
    }

    /// Ends a request: frees its KV, flushes held text, emits its terminal event.
    fn finish(
        &mut self,
        id: RequestId,
        reason: FinishReason,
        tokens: Vec<u32>,
        mut text: String,
        logprobs: Vec<TokenLogprob>,
        events: &mut Vec<Event>,
    ) {
        let Some(mut req) = self.requests.remove(&id) else {
            return;
        };
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        if req.in_kv {
            self.kv.release(id);
        }
        if !matches!(reason, FinishReason::StopString(_)) {
            if let (Some(detok), Some(_)) = (req.detok.as_mut(), self.model.tokenizer.as_ref()) {
                let rest = detok.flush();
                let out = req.stop.push(&rest);
                text.push_str(&out.text);
            }
            text.push_str(&req.stop.flush());
        }
        events.push(Event {
            request_id: id,
            tokens,
            text,
            logprobs,
            finish: Some(reason),
        });
    }
}
