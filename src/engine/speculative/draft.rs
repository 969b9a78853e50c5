//! Draft-model proposals: a smaller model with the target's vocabulary
//! (another model of the family, or an int4 copy of the target) decodes
//! greedily a few tokens ahead. It keeps a KV cache of its own for each
//! speculating request, in the session's KV budget, and catches up on the
//! tokens the target accepted since its last draft.

use super::{Ask, Proposer};
use crate::engine::model::Model;
use crate::engine::request::RequestId;
use crate::forward::{AttnSeq, ForwardBatch};
use crate::kv::KvCacheBackend;
use crate::model::{ForwardContext, NON_FINITE_ROW};
use crate::{bail_arg, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// Where a draft model runs: its forward context and KV manager, built by
/// the session (which sizes them).
pub struct DraftContext {
    pub ctx: Box<dyn ForwardContext>,
    pub kv: Box<dyn KvCacheBackend>,
    /// Most rows in one forward of `ctx`.
    pub max_rows: usize,
    /// Most rows wanting logits in one forward of `ctx`.
    pub max_logits_rows: usize,
}

/// What the draft model holds for one request.
#[derive(Default)]
struct DraftSeq {
    /// Leading tokens of the request whose KV the draft computed.
    computed: usize,
    /// Drafted tokens whose KV it computed after those (positions
    /// `computed..`): they count once the target accepts them.
    fed: Vec<u32>,
    /// The request holds a token the draft model has no embedding for.
    unusable: bool,
}

pub struct DraftProposer {
    model: Arc<Model>,
    /// Drafts stop at an id the target cannot sample.
    sample_vocab: usize,
    draft: DraftContext,
    seqs: HashMap<RequestId, DraftSeq>,
    // Scratch of one forward.
    tokens: Vec<u32>,
    logits_rows: Vec<usize>,
    ids: Vec<u32>,
    /// (ask, rows) of the forward being built.
    rows: Vec<(usize, usize)>,
}

/// Refuses a draft model whose token ids do not mean what the target's do.
pub fn check_vocabulary(target: &Model, draft: &Model) -> Result<()> {
    if draft.decoder.device() != target.decoder.device() {
        bail_arg!(
            "the draft model is on {} but the target is on {}; load both on one device",
            draft.decoder.device(),
            target.decoder.device()
        );
    }
    if draft.sample_vocab != target.sample_vocab {
        bail_arg!(
            "the draft model's vocabulary has {} tokens but the target's has {}; \
             a draft model must share the target's tokenizer",
            draft.sample_vocab,
            target.sample_vocab
        );
    }
    match (&target.tokenizer, &draft.tokenizer) {
        (Some(t), Some(d)) => {
            for id in 0..target.sample_vocab as u32 {
                if t.id_to_token(id) != d.id_to_token(id) {
                    bail_arg!(
                        "token id {id} is {:?} for the target but {:?} for the draft model; \
                         a draft model must share the target's tokenizer",
                        t.id_to_token(id).unwrap_or_default(),
                        d.id_to_token(id).unwrap_or_default()
                    );
                }
            }
        }
        (None, None) => {}
        _ => bail_arg!("one of the target and draft models has a tokenizer and the other not"),
    }
    Ok(())
}

impl DraftProposer {
    pub fn new(model: Arc<Model>, sample_vocab: usize, draft: DraftContext) -> Self {
        DraftProposer {
            model,
            sample_vocab,
            draft,
            seqs: HashMap::new(),
            tokens: Vec::new(),
            logits_rows: Vec::new(),
            ids: Vec::new(),
            rows: Vec::new(),
        }
    }

    /// Brings request `ask`'s draft state up to its tokens: drafts the
    /// target accepted become computed, the rest of the draft's KV is
    /// dropped. Returns the tokens still to feed: at least the last one
    /// when the ask wants a draft (its logits give the first drafted
    /// token); with `k` 0 (catching up on a prompt) everything not yet fed.
    fn sync(&mut self, ask: &Ask<'_>) -> usize {
        let kv = &mut self.draft.kv;
        let seq = self.seqs.entry(ask.id).or_insert_with(|| {
            kv.begin(ask.id, ask.tokens, 0);
            DraftSeq::default()
        });
        let len = ask.tokens.len();
        let ahead = &ask.tokens[seq.computed.min(len)..];
        let kept = seq.fed.iter().zip(ahead).take_while(|(a, b)| a == b);
        let last = if ask.k > 0 { len - 1 } else { len };
        seq.computed = (seq.computed + kept.count()).min(last);
        seq.fed.clear();
        kv.truncate(ask.id, seq.computed);
        len - seq.computed
    }

    /// Runs the forward over `self.tokens` / `self.rows` (rows of `asks`,
    /// each continuing at its `computed + fed`) and writes the argmax of
    /// each logits row into `self.ids`.
    fn forward(&mut self, asks: &[Ask<'_>]) -> Result<()> {
        let mut seqs = Vec::with_capacity(self.rows.len());
        let mut start = 0;
        for &(i, n) in &self.rows {
            let seq = &self.seqs[&asks[i].id];
            seqs.push(AttnSeq {
                start,
                len: n,
                context_len: seq.computed + seq.fed.len(),
                kv: self.draft.kv.mapping(asks[i].id),
            });
            start += n;
        }
        let batch = ForwardBatch {
            tokens: &self.tokens,
            seqs: &seqs,
            logits_rows: &self.logits_rows,
            stop: None,
        };
        self.ids.resize(self.logits_rows.len(), 0);
        self.draft.ctx.forward_argmax(&batch, &mut self.ids)
    }

    /// Whether `id` is a token a draft may hold.
    fn draftable(&self, id: u32) -> bool {
        id != NON_FINITE_ROW && (id as usize) < self.sample_vocab
    }
}

impl Proposer for DraftProposer {
    fn propose(&mut self, asks: &[Ask<'_>], drafts: &mut [Vec<u32>]) {
        let vocab = self.model.config().vocab_size;
        // Catch up: every request's uncomputed tokens, in one forward of at
        // most `max_rows` rows; a request whose rows all fit drafts its
        // first token from the last of them.
        self.tokens.clear();
        self.logits_rows.clear();
        self.rows.clear();
        for (i, ask) in asks.iter().enumerate() {
            let pending = self.sync(ask);
            let room = self.draft.max_rows - self.tokens.len();
            let n = pending.min(room);
            let seq = self.seqs.get_mut(&ask.id).expect("synced");
            let new = &ask.tokens[seq.computed..seq.computed + n];
            seq.unusable |= new.iter().any(|&t| t as usize >= vocab);
            if n == 0 || seq.unusable || !self.draft.kv.allocate(ask.id, seq.computed + n) {
                continue;
            }
            self.tokens.extend_from_slice(new);
            if ask.k > 0 && n == pending && self.logits_rows.len() < self.draft.max_logits_rows {
                self.logits_rows.push(self.tokens.len() - 1);
            }
            self.rows.push((i, n));
        }
        if self.rows.is_empty() || self.forward(asks).is_err() {
            return;
        }
        // Who drafts on, by ask: the rows with logits are the caught-up ones.
        let mut live = Vec::with_capacity(self.logits_rows.len());
        let mut row = 0;
        for &(i, n) in &self.rows {
            let seq = self.seqs.get_mut(&asks[i].id).expect("synced");
            seq.computed += n;
            if asks[i].k > 0 && seq.computed == asks[i].tokens.len() {
                let id = self.ids[row];
                row += 1;
                if self.draftable(id) {
                    drafts[i].push(id);
                    live.push(i);
                }
            }
        }
        // Then one row per request per further token.
        while !live.is_empty() {
            live.retain(|&i| drafts[i].len() < asks[i].k);
            self.tokens.clear();
            self.logits_rows.clear();
            self.rows.clear();
            for &i in &live {
                let seq = &self.seqs[&asks[i].id];
                let at = seq.computed + seq.fed.len();
                if self.logits_rows.len() == self.draft.max_logits_rows
                    || !self.draft.kv.allocate(asks[i].id, at + 1)
                {
                    continue;
                }
                self.logits_rows.push(self.tokens.len());
                self.tokens
                    .push(*drafts[i].last().expect("live drafts are not empty"));
                self.rows.push((i, 1));
            }
            if self.rows.is_empty() || self.forward(asks).is_err() {
                return;
            }
            live.clear();
            for (r, &(i, _)) in self.rows.iter().enumerate() {
                let fed = *drafts[i].last().expect("live drafts are not empty");
                let seq = self.seqs.get_mut(&asks[i].id).expect("synced");
                seq.fed.push(fed);
                if self.draftable(self.ids[r]) {
                    drafts[i].push(self.ids[r]);
                    live.push(i);
                }
            }
        }
    }

    fn release(&mut self, id: RequestId) {
        if self.seqs.remove(&id).is_some() {
            self.draft.kv.release(id);
        }
    }

    fn kv_used_slots(&self) -> usize {
        self.draft.kv.stats().used_slots
    }
}
