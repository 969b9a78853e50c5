//! Sampling on the device that computed the logits: each row's stage chain
//! (see `processors`) resolved on the host into parameters and flat token
//! lists, so a device kernel can run the same stages without the logits
//! ever coming back to the host.
//!
//! The RNG stays on the host: a row that draws carries the uniform its
//! request's stream yields at exactly the point where the CPU sampler would
//! draw it, so one seed gives one stream whichever side samples.
//!
//! A row under a structured-output grammar takes its allowed-token mask as
//! well. The mask is known only once the host has computed it, which it does
//! while the device runs the forward: the device asks for the step's masks
//! (a `MaskFill`) after queuing the forward and before queuing the sampling.

use std::ops::Range;

/// One logits row's stages, as `SamplingPlan` plus the uniform of its draw.
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    pub repetition_penalty: Option<f32>,
    /// `None` = greedy: the argmax of the processed logits.
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// `ln(min_p)`: min-p keeps `logit - max >= min_p_floor`.
    pub min_p_floor: Option<f32>,
    /// Uniform in [0, 1) of the draw (0 when greedy).
    pub u: f64,
    /// Ranges of `DeviceSampling::edits`, applied in this order:
    /// distinct prompt + output tokens (repetition penalty, value unused),
    /// output tokens with the amount to subtract (presence/frequency),
    /// logit bias (added, in list order), suppressed tokens (value unused).
    pub repeated: Range<usize>,
    pub penalized: Range<usize>,
    pub biased: Range<usize>,
    pub suppressed: Range<usize>,
    /// `Some((presence, frequency))`: the row was launched before its
    /// previous token reached the host (overlapped steps). The device takes
    /// that token, the id its previous launch chose for this row, as one
    /// more output token the lists above do not hold yet: the repetition
    /// penalty applies to it unless it is in `repeated`, and it adds
    /// `frequency` to its `penalized` amount (`frequency + presence` when
    /// it is not there).
    pub pending: Option<(f32, f32)>,
    /// The row's first stage is its grammar's mask: every token the mask
    /// does not allow gets -inf. The masks come from the step's `MaskFill`.
    pub masked: bool,
}

impl RowSampling {
    /// Plain greedy: no stage, the argmax of the raw logits.
    pub fn greedy() -> RowSampling {
        RowSampling {
            repetition_penalty: None,
            temperature: None,
            top_k: None,
            top_p: None,
            min_p_floor: None,
            u: 0.0,
            repeated: 0..0,
            penalized: 0..0,
            biased: 0..0,
            suppressed: 0..0,
            pending: None,
            masked: false,
        }
    }
}

/// Writes the masks of a step's masked rows (`RowSampling::masked`), one
/// after the other in row order, `mask_words(vocab)` words each: bit
/// `t % 32` of word `t / 32` is set when token `t` is allowed. A device
/// calls it once, after queuing the forward and before queuing the
/// sampling, so the host computes the masks while the forward runs.
pub type MaskFill<'a> = dyn FnMut(&mut [u32]) + 'a;

/// Words of one row's mask over a vocabulary of `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// The sampling of one forward's logits rows, in row order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceSampling {
    pub rows: Vec<RowSampling>,
    /// `(token, value)` pairs the rows' ranges point into.
    pub edits: Vec<(u32, f32)>,
    /// Rows the host samples itself (requests that want logprobs): the
    /// device returns their logits instead, in this (ascending) order. Their
    /// entries in `rows` are placeholders.
    pub host_rows: Vec<usize>,
}

impl DeviceSampling {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.edits.clear();
        self.host_rows.clear();
    }

    /// Appends a row the host samples from its logits.
    pub fn push_host_row(&mut self) {
        self.host_rows.push(self.rows.len());
        // A placeholder: the device does not sample it.
        self.rows.push(RowSampling::greedy());
    }

    /// Whether row `i` is sampled on the host.
    pub fn on_host(&self, i: usize) -> bool {
        self.host_rows.binary_search(&i).is_ok()
    }

    /// Rows whose first stage is a grammar's mask.
    pub fn masked_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.masked).count()
    }

    /// Appends `tokens` with `value` each and returns their range.
    pub(crate) fn push_edits(
        &mut self,
        tokens: impl IntoIterator<Item = (u32, f32)>,
    ) -> Range<usize> {
        let start = self.edits.len();
        self.edits.extend(tokens);
        start..self.edits.len()
    }
}
