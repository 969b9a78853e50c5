//! Running the planned batch and turning its logits into tokens and events.

use super::{Request, Session, TokensFrom};
use crate::engine::request::{Event, FinishReason, RequestId, TokenLogprob};
use crate::forward::AttnSeq;
use crate::model::NON_FINITE_ROW;
use crate::model::{ForwardBatch, StepStop};
use crate::sampling::{check_finite_logits, mask_words, non_finite_logits, MaskFill, SampledToken};
use crate::Error;
use std::time::Instant;

/// Threads that compute structured-output masks during a device's forward.
const MASK_THREADS: usize = 4;

impl Session {
    /// One forward over the plan. A sequence wants logits when this step
    /// computes its last known token; those rows are listed in plan order,
    /// which is the order `finish_step` consumes them in. Returns true when
    /// the forward was launched rather than run (overlapped steps, every
    /// row's id chosen on the device): its ids are collected by `land`.
    /// The second value tells whether a cancel from another thread asked
    /// the forward to stop (see `Canceller`).
    pub(super) fn run_forward(&mut self) -> (crate::Result<bool>, bool) {
        let Session {
            kv,
            ctx,
            logits,
            requests,
            scratch,
            model,
            stats,
            overlap,
            canceller,
            abort,
            ..
        } = self;
        scratch.tokens.clear();
        scratch.logits_rows.clear();
        let mut seqs = relabel(std::mem::take(&mut scratch.seqs));
        let mut greedy = true;
        let mut any_device_row = false;
        let mut speculating = false;
        for &(id, n) in &scratch.plan {
            let req = &requests[&id];
            let start = scratch.tokens.len();
            scratch
                .tokens
                .extend_from_slice(&req.tokens[req.computed..req.computed + n]);
            // Drafted tokens follow the last known one, each wanting logits.
            scratch.tokens.extend_from_slice(&req.draft);
            let n = n + req.draft.len();
            speculating |= !req.draft.is_empty();
            if req.computed + n - req.draft.len() == req.tokens.len() {
                scratch
                    .logits_rows
                    .extend(start + n - 1 - req.draft.len()..start + n);
                let generated = req.tokens.len() - req.prompt_len;
                let suppressing = generated < req.params.sampling.min_tokens as usize;
                greedy &= req.sampler.is_plain_greedy() && !suppressing;
                any_device_row |= req.sampler.samples_on_device();
            }
            seqs.push(AttnSeq {
                start,
                len: n,
                context_len: req.computed,
                kv: kv.mapping(id),
            });
        }
        let stop = StepStop {
            cancel: canceller.stop_flag(),
            abort: abort.as_deref(),
        };
        let batch = ForwardBatch {
            tokens: &scratch.tokens,
            seqs: &seqs,
            logits_rows: &scratch.logits_rows,
            stop: Some(&stop),
        };
        let sampled_rows = scratch.logits_rows.len();
        let device_samples =
            any_device_row && scratch.allow_device_sampling && ctx.samples_on_device();
        // The device samples one row per request: drafted rows that are not
        // plain greedy are sampled here, one after another.
        scratch.tokens_from = match () {
            _ if sampled_rows == 0 => TokensFrom::HostSampler,
            _ if greedy => TokensFrom::DeviceArgmax,
            _ if device_samples && !speculating => TokensFrom::DeviceSampler,
            _ => TokensFrom::HostSampler,
        };
        scratch.device_tokens.resize(sampled_rows, 0);
        if scratch.tokens_from == TokensFrom::DeviceSampler {
            let vocab = model.config().vocab_size;
            scratch.device_sampling.clear();
            for &(id, n) in &scratch.plan {
                let req = requests.get_mut(&id).expect("scheduled request exists");
                if req.computed + n < req.tokens.len() {
                    continue;
                }
                if !req.sampler.samples_on_device() {
                    scratch.device_sampling.push_host_row();
                    continue;
                }
                suppression(req, &model.eos_token_ids, &mut scratch.suppress);
                let (prompt, output) = req.tokens.split_at(req.history_start);
                req.sampler.push_device_row(
                    vocab,
                    prompt,
                    output,
                    &scratch.suppress,
                    &mut scratch.device_sampling,
                );
            }
        }
        let forward_started = Instant::now();
        let sampled_on_device = scratch.tokens_from == TokensFrom::DeviceSampler
            && scratch.device_sampling.host_rows.is_empty()
            && scratch.device_sampling.masked_rows() == 0;
        let launch = *overlap
            && !speculating
            && (scratch.tokens_from == TokensFrom::DeviceArgmax || sampled_on_device);
        canceller.begin_forward(scratch.plan.iter().map(|&(id, _)| id));
        // Structured-output rows need their grammar's mask after the
        // forward. Where the forward runs on a device (the host only waits
        // for it), the masks are computed meanwhile on helper threads, and
        // those of the rows the device samples packed for it; on the CPU
        // the forward has the cores, and the sampler computes each mask
        // when it samples. Listed in plan order (each with whether its row
        // is masked on the device), which is the masks' row order.
        let mut grammar: Vec<(RequestId, bool)> = Vec::new();
        if ctx.samples_on_device() && !launch {
            let mut row = 0;
            for &(id, n) in &scratch.plan {
                let req = &requests[&id];
                let sampled = req.computed + n == req.tokens.len();
                let masked = sampled
                    && scratch.tokens_from == TokensFrom::DeviceSampler
                    && scratch.device_sampling.rows[row].masked;
                row += usize::from(sampled);
                if req.sampler.has_grammar() {
                    grammar.push((id, masked));
                }
            }
        }
        let mut samplers: Vec<(usize, bool, &mut crate::sampling::Sampler)> = if grammar.is_empty()
        {
            Vec::new()
        } else {
            let mut by_id: Vec<(RequestId, usize)> =
                grammar.iter().enumerate().map(|(k, g)| (g.0, k)).collect();
            by_id.sort_unstable();
            let mut v: Vec<_> = requests
                .iter_mut()
                .filter_map(|(id, r)| {
                    let k = by_id[by_id.binary_search_by_key(id, |e| e.0).ok()?].1;
                    Some((k, grammar[k].1, &mut r.sampler))
                })
                .collect();
            v.sort_unstable_by_key(|e| e.0);
            v
        };
        let sample_vocab = model.sample_vocab;
        let mask_len = mask_words(model.config().vocab_size);
        let mut forward = |masks: &mut MaskFill<'_>| match scratch.tokens_from {
            _ if launch => {
                let sampling = sampled_on_device.then_some(&scratch.device_sampling);
                ctx.launch(&batch, sampling, false)
            }
            TokensFrom::HostSampler => ctx.forward(&batch, logits),
            TokensFrom::DeviceArgmax => ctx.forward_argmax(&batch, &mut scratch.device_tokens),
            TokensFrom::DeviceSampler => ctx.forward_sample(
                &batch,
                &scratch.device_sampling,
                masks,
                &mut scratch.device_tokens,
                logits,
            ),
        };
        // (A scope allocates: entered only when there are masks to compute,
        // so that plain decode steps stay allocation-free.)
        let result = if samplers.is_empty() {
            forward(&mut |masks| debug_assert!(masks.is_empty()))
        } else {
            let masked = samplers.iter().filter(|s| s.1).count();
            let mut packed = vec![0u32; masked * mask_len];
            std::thread::scope(|scope| {
                let per_thread = samplers.len().div_ceil(MASK_THREADS);
                let mut rest = packed.as_mut_slice();
                let mut threads = Vec::with_capacity(MASK_THREADS);
                for chunk in samplers.chunks_mut(per_thread) {
                    let words = chunk.iter().filter(|s| s.1).count() * mask_len;
                    let (out, tail) = std::mem::take(&mut rest).split_at_mut(words);
                    rest = tail;
                    threads.push(scope.spawn(move || {
                        let mut rows = out.chunks_exact_mut(mask_len);
                        for (_, masked, s) in chunk.iter_mut() {
                            if *masked {
                                let row = rows.next().expect("a mask per masked row");
                                s.pack_grammar_mask(sample_vocab, row);
                            } else {
                                s.prepare_grammar();
                            }
                        }
                        out
                    }));
                }
                // The device asks for the masks once its forward is queued.
                forward(&mut |masks| {
                    let mut at = 0;
                    for t in threads.drain(..) {
                        let out = t.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                        masks[at..at + out.len()].copy_from_slice(out);
                        at += out.len();
                    }
                    debug_assert_eq!(at, masks.len());
                })
            })
        };
        let interrupted_by_cancel = canceller.end_forward();
        stats.forward_time_ns += forward_started.elapsed().as_nanos() as u64;
        seqs.clear();
        scratch.seqs = relabel(seqs);
        (result.map(|()| launch), interrupted_by_cancel)
    }

    pub(super) fn fail_scheduled(&mut self, err: &Error, events: &mut Vec<Event>) {
        let plan = std::mem::take(&mut self.scratch.plan);
        for &(id, _) in &plan {
            let event = self.new_event(id);
            self.finish(event, FinishReason::Error(err.message.clone()), events);
        }
        self.scratch.plan = plan;
    }

    /// Commits the computed KV of every planned request, samples the ones
    /// that reached their last token and reports their events.
    pub(super) fn finish_step(&mut self, events: &mut Vec<Event>) {
        let vocab = self.model.config().vocab_size;
        let plan = std::mem::take(&mut self.scratch.plan);
        // Taken out for the loop so rows can be lent to `&mut self` methods.
        let mut logits = std::mem::take(&mut self.logits);
        let mut logits_row = 0;
        // Logits rows the device returned for host sampling, consumed in order.
        let mut host_rows_done = 0;
        for &(id, n) in &plan {
            let req = self
                .requests
                .get_mut(&id)
                .expect("scheduled request exists");
            let is_decode =
                n == 1 && req.computed + 1 == req.tokens.len() && req.computed >= req.prompt_len;
            req.computed += n;
            if is_decode {
                self.stats.decode_tokens += 1;
            } else {
                self.stats.prefill_tokens += n as u64;
            }
            self.kv.commit(id, &req.tokens[..req.computed]);
            if req.computed < req.tokens.len() {
                continue; // a non-final prefill chunk: no logits, no event
            }
            if !req.draft.is_empty() {
                let rows = 1 + req.draft.len();
                self.verify_drafts(id, logits_row, &mut logits, events);
                logits_row += rows;
                continue;
            }
            let from = self.scratch.tokens_from;
            let sampled = if from == TokensFrom::HostSampler {
                self.sample(
                    id,
                    &mut logits[logits_row * vocab..(logits_row + 1) * vocab],
                )
            } else if from == TokensFrom::DeviceSampler
                && self.scratch.device_sampling.on_host(logits_row)
            {
                let row = host_rows_done;
                host_rows_done += 1;
                self.sample(id, &mut logits[row * vocab..(row + 1) * vocab])
            } else {
                self.device_sampled(id, logits_row)
            };
            logits_row += 1;
            self.count_masks(id);
            match sampled {
                Ok(sampled) => self.report(id, sampled, events),
                Err(e) => {
                    let event = self.new_event(id);
                    self.finish(event, FinishReason::Error(e.message), events)
                }
            }
        }
        self.logits = logits;
        self.scratch.plan = plan;
    }

    /// The token the device chose for logits row `row` of request `id`.
    pub(super) fn device_sampled(
        &mut self,
        id: RequestId,
        row: usize,
    ) -> crate::Result<SampledToken> {
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        let sample_vocab = self.model.sample_vocab;
        let t = device_token(self.scratch.device_tokens[row], sample_vocab)?;
        req.sampler.accept_device_token(sample_vocab, t.token)?;
        Ok(t)
    }

    /// Runs the request's sampler over its logits row.
    pub(super) fn sample(
        &mut self,
        id: RequestId,
        logits: &mut [f32],
    ) -> crate::Result<SampledToken> {
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        check_finite_logits(logits)?;
        let suppress = &mut self.scratch.suppress;
        suppression(req, &self.model.eos_token_ids, suppress);
        let (prompt, output) = req.tokens.split_at(req.history_start);
        // Rows past the tokenizer are left out: they have no text.
        let logits = &mut logits[..self.model.sample_vocab];
        req.sampler.sample(logits, prompt, output, suppress)
    }

    /// Adds the masks the request's grammar computed (while the forward ran
    /// or when it was sampled, on the host or the device) to the stats.
    pub(super) fn count_masks(&mut self, id: RequestId) {
        let masks = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists")
            .sampler
            .take_mask_stats();
        self.stats.constraint_masks += masks.masks;
        self.stats.constraint_mask_time_ns += masks.time_ns;
        self.stats.constraint_masks_over_budget += masks.over_budget;
    }

    /// Appends the sampled token and reports it (finishing the request when
    /// it stops).
    fn report(&mut self, id: RequestId, sampled: SampledToken, events: &mut Vec<Event>) {
        let mut event = self.new_event(id);
        match self.push_token(id, sampled, &mut event) {
            Some(r) => self.finish(event, r, events),
            None => events.push(event),
        }
    }

    /// Appends the sampled token to the request and to its `event`; returns
    /// why the request ends when this token ends it.
    pub(super) fn push_token(
        &mut self,
        id: RequestId,
        sampled: SampledToken,
        event: &mut Event,
    ) -> Option<FinishReason> {
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        req.tokens.push(sampled.token);
        event.tokens.push(sampled.token);
        if req.params.sampling.logprobs > 0 {
            event.logprobs.push(TokenLogprob {
                token: sampled.token,
                logprob: sampled.logprob,
                top: sampled.top_logprobs,
            });
        }
        let mut stop_hit = None;
        if let (Some(detok), Some(tok)) = (req.detok.as_mut(), self.model.tokenizer.as_ref()) {
            let delta = detok.push(tok, sampled.token).unwrap_or_default();
            let out = req.stop.push(&delta);
            event.text.push_str(&out.text);
            stop_hit = out.stop;
        }
        let generated = req.tokens.len() - req.prompt_len;
        let s = &req.params.sampling;
        if let Some(i) = stop_hit {
            return Some(FinishReason::StopString(i));
        }
        if !s.ignore_eos && self.model.eos_token_ids.contains(&sampled.token) {
            Some(FinishReason::Eos)
        } else if s.stop_token_ids.contains(&sampled.token) {
            Some(FinishReason::StopToken(sampled.token))
        } else if generated >= s.max_tokens as usize
            || req.tokens.len() >= self.model.config().max_position_embeddings
        {
            Some(if req.sampler.grammar_unfinished() {
                FinishReason::LengthUnfinished
            } else {
                FinishReason::Length
            })
        } else {
            None
        }
    }

    /// Ends the request of `event`: frees its KV, flushes held text into
    /// the event and emits it as the terminal event.
    pub(super) fn finish(
        &mut self,
        mut event: Event,
        mut reason: FinishReason,
        events: &mut Vec<Event>,
    ) {
        let id = event.request_id;
        let Some(mut req) = self.requests.remove(&id) else {
            self.scratch.spare_events.push(event);
            return;
        };
        if !self.canceller.forget(id) {
            // Cancelled from another thread while this step ran: the cancel
            // succeeded, so that is how the request ends.
            reason = FinishReason::Cancelled;
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        self.retain_if_asked(id, &req, &reason);
        if req.in_kv {
            self.kv.release(id);
        }
        self.release_draft(id);
        event.usage = Some(self.usage(id, &req));
        if !matches!(reason, FinishReason::StopString(_)) {
            if let (Some(detok), Some(_)) = (req.detok.as_mut(), self.model.tokenizer.as_ref()) {
                let rest = detok.flush();
                let out = req.stop.push(&rest);
                event.text.push_str(&out.text);
            }
            event.text.push_str(&req.stop.flush());
        }
        event.finish = Some(reason);
        events.push(event);
    }
}

/// A token the device chose; one the host could not have sampled (a
/// non-finite logits row, an id the tokenizer lacks) fails the request.
fn device_token(token: u32, sample_vocab: usize) -> crate::Result<SampledToken> {
    if token == NON_FINITE_ROW {
        return Err(non_finite_logits(None));
    }
    if token as usize >= sample_vocab {
        return Err(Error::invalid_model(format!(
            "the model generated token id {token}, which has no token in tokenizer.json \
             (it covers ids below {sample_vocab}); the request was stopped"
        )));
    }
    Ok(SampledToken {
        token,
        logprob: f32::NAN,
        top_logprobs: Vec::new(),
    })
}

/// Reuses an empty vector of batch sequences under another lifetime, so the
/// batch is built without allocating once the vector has grown.
pub(super) fn relabel<'a, 'b>(mut seqs: Vec<AttnSeq<'a>>) -> Vec<AttnSeq<'b>> {
    seqs.clear();
    let mut seqs = std::mem::ManuallyDrop::new(seqs);
    let (ptr, capacity) = (seqs.as_mut_ptr(), seqs.capacity());
    // SAFETY: `AttnSeq<'a>` and `AttnSeq<'b>` differ only in a lifetime, so
    // they have one layout; the vector is empty, so no value of the old
    // lifetime is reinterpreted; ownership of the buffer moves over (the
    // original is never dropped).
    unsafe { Vec::from_raw_parts(ptr.cast::<AttnSeq<'b>>(), 0, capacity) }
}

/// The ids `req` may not sample this step (EOS and stop ids before
/// `min_tokens`).
fn suppression(req: &Request, eos_ids: &[u32], out: &mut Vec<u32>) {
    req.params
        .sampling
        .min_tokens_suppression(eos_ids, req.tokens.len() - req.prompt_len, out);
}
