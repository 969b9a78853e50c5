//! Host side of `sample_rows` (kernels/sampling.cu): the rows' sampling
//! records laid out as the kernel reads them, and the launch.

use super::{CudaDevice, DeviceBuffer, KArg};
use crate::forward::{mask_words, DeviceSampling, MaskFill};
use crate::{bail_arg, Result};
use std::ops::Range;

/// SAMPLE_* of kernels/sampling.cu.
const ROW_WORDS: usize = 16;
const THREADS: u32 = 1024;
const TEMPERATURE: u32 = 1;
const TOP_K: u32 = 2;
const TOP_P: u32 = 4;
const MIN_P: u32 = 8;
const REPETITION: u32 = 1 << 4;
const ON_HOST: u32 = 1 << 5;
const PENDING: u32 = 1 << 6;
/// The record's word holding the offset of its row's mask.
const MASK_AT: usize = 15;
/// The kernel selects ids 8 bits at a time, three passes.
const MAX_VOCAB: usize = 1 << 24;

/// Writes `sampling` into `words`: one record of `ROW_WORDS` per row, then
/// each row's edits as (token, value bits), in stage order, then room for
/// the masked rows' masks (`vocab` tokens each), in row order. Returns
/// where the masks go; the caller fills them (`MaskFill`).
pub fn encode(sampling: &DeviceSampling, vocab: usize, words: &mut Vec<u32>) -> Range<usize> {
    words.clear();
    words.resize(sampling.rows.len() * ROW_WORDS, 0);
    for (i, row) in sampling.rows.iter().enumerate() {
        if sampling.on_host(i) {
            words[i * ROW_WORDS] = ON_HOST;
            continue;
        }
        let flag = |on: bool, bit: u32| if on { bit } else { 0 };
        let lists = [&row.repeated, &row.penalized, &row.biased, &row.suppressed];
        let record = [
            flag(row.temperature.is_some(), TEMPERATURE)
                | flag(row.top_k.is_some(), TOP_K)
                | flag(row.top_p.is_some(), TOP_P)
                | flag(row.min_p_floor.is_some(), MIN_P)
                | flag(row.repetition_penalty.is_some(), REPETITION)
                | flag(row.pending.is_some(), PENDING),
            row.temperature.unwrap_or(1.0).to_bits(),
            row.top_k.map_or(0, |k| k.min(u32::MAX as usize) as u32),
            row.top_p.unwrap_or(1.0).to_bits(),
            row.min_p_floor.unwrap_or(f32::NEG_INFINITY).to_bits(),
            row.repetition_penalty.unwrap_or(1.0).to_bits(),
            row.u.to_bits() as u32,
            (row.u.to_bits() >> 32) as u32,
            words.len() as u32,
            lists[0].len() as u32,
            lists[1].len() as u32,
            lists[2].len() as u32,
            lists[3].len() as u32,
            row.pending.map_or(0, |(presence, _)| presence.to_bits()),
            row.pending.map_or(0, |(_, frequency)| frequency.to_bits()),
            // The mask's offset, set below (0: none; offset 0 is a record).
            0,
        ];
        words[i * ROW_WORDS..i * ROW_WORDS + record.len()].copy_from_slice(&record);
        for list in lists {
            for &(token, value) in &sampling.edits[list.clone()] {
                words.extend([token, value.to_bits()]);
            }
        }
    }
    let start = words.len();
    let mut end = start;
    for (i, row) in sampling.rows.iter().enumerate() {
        if row.masked && !sampling.on_host(i) {
            words[i * ROW_WORDS + MASK_AT] = end as u32;
            end += mask_words(vocab);
        }
    }
    words.resize(end, 0);
    start..end
}

/// `encode`, then the masks from `fill`, which is asked only when a row
/// is masked.
pub fn encode_filled(
    sampling: &DeviceSampling,
    vocab: usize,
    words: &mut Vec<u32>,
    fill: &mut MaskFill<'_>,
) {
    let masks = encode(sampling, vocab, words);
    if !masks.is_empty() {
        fill(&mut words[masks]);
    }
}

/// Enqueues the sampling of `rows` logits rows (`[rows, vocab]` f32 at
/// `logits`, processed in place) from the encoded records at `params`,
/// choosing among the first `choosable` ids of each; token ids go to `ids`.
pub fn enqueue(
    dev: &CudaDevice,
    logits: u64,
    (vocab, choosable): (usize, usize),
    rows: usize,
    params: u64,
    ids: u64,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    if vocab > MAX_VOCAB {
        bail_arg!(
            "sampling on the GPU supports vocabularies up to {MAX_VOCAB} tokens, not {vocab}"
        );
    }
    dev.launch(
        &dev.kernels.sample_rows,
        (rows as u32, 1, 1),
        THREADS,
        &[
            KArg::Ptr(logits),
            KArg::I32(vocab as i32),
            KArg::I32(choosable.min(vocab) as i32),
            KArg::Ptr(params),
            KArg::Ptr(ids),
        ],
    )
}

/// Samples host `logits` (`[rows, vocab]`) on the GPU: the kernel on its
/// own, for tests and tools. Returns one token per row.
pub fn sample_logits(
    dev: &CudaDevice,
    logits: &[f32],
    vocab: usize,
    sampling: &DeviceSampling,
) -> Result<Vec<u32>> {
    sample_logits_after(dev, logits, vocab, sampling, &vec![0; sampling.rows.len()])
}

/// `sample_logits` with `previous[r]` as the id an earlier launch left for
/// row `r`: the pending token of rows marked `RowSampling::pending`.
pub fn sample_logits_after(
    dev: &CudaDevice,
    logits: &[f32],
    vocab: usize,
    sampling: &DeviceSampling,
    previous: &[u32],
) -> Result<Vec<u32>> {
    sample_logits_masked(dev, logits, vocab, sampling, previous, &[])
}

/// `sample_logits_after` with the masks of the masked rows (`MaskFill`'s
/// layout) in `masks`.
pub fn sample_logits_masked(
    dev: &CudaDevice,
    logits: &[f32],
    vocab: usize,
    sampling: &DeviceSampling,
    previous: &[u32],
    masks: &[u32],
) -> Result<Vec<u32>> {
    let rows = sampling.rows.len();
    let mut words = Vec::new();
    let masks_at = encode(sampling, vocab, &mut words);
    if logits.len() != rows * vocab || previous.len() != rows || masks.len() != masks_at.len() {
        bail_arg!(
            "sample_logits: {} logits, {} previous ids and {} mask words for {rows} rows of {vocab}",
            logits.len(),
            previous.len(),
            masks.len()
        );
    }
    words[masks_at].copy_from_slice(masks);
    let mut d_logits: DeviceBuffer<f32> = dev.alloc(logits.len().max(1))?;
    let mut d_words: DeviceBuffer<u32> = dev.alloc(words.len().max(1))?;
    let mut d_ids: DeviceBuffer<u32> = dev.alloc(rows.max(1))?;
    dev.upload(previous, &mut d_ids)?;
    dev.upload(logits, &mut d_logits)?;
    dev.upload(&words, &mut d_words)?;
    enqueue(
        dev,
        d_logits.ptr(),
        (vocab, vocab),
        rows,
        d_words.ptr(),
        d_ids.ptr(),
    )?;
    let mut ids = vec![0u32; rows];
    dev.download(&d_ids, &mut ids)?;
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::RowSampling;

    #[test]
    fn records_and_edits_follow_the_kernel_layout() {
        let mut s = DeviceSampling::default();
        let greedy = RowSampling {
            repetition_penalty: Some(1.5),
            temperature: None,
            top_k: None,
            top_p: None,
            min_p_floor: None,
            u: 0.0,
            repeated: s.push_edits([(4, 0.0), (9, 0.0)]),
            penalized: 0..0,
            biased: s.push_edits([(2, 0.5)]),
            suppressed: 0..0,
            pending: None,
            masked: true,
        };
        let masked_too = RowSampling {
            repeated: 0..0,
            biased: 0..0,
            ..greedy.clone()
        };
        s.rows.push(greedy);
        // A row whose lists were pushed out of stage order.
        let suppressed = s.push_edits([(0, 0.0)]);
        let penalized = s.push_edits([(7, 0.25)]);
        s.rows.push(RowSampling {
            repetition_penalty: None,
            temperature: Some(0.5),
            top_k: Some(40),
            top_p: Some(0.9),
            min_p_floor: Some(-3.0),
            u: 0.75,
            repeated: 0..0,
            penalized,
            biased: 0..0,
            suppressed,
            pending: Some((0.25, 0.5)),
            masked: false,
        });
        s.push_host_row();
        s.rows.push(masked_too);
        assert!(s.on_host(2) && !s.on_host(1));
        let mut w = Vec::new();
        let vocab = 40; // two mask words a row
        let masks = encode(&s, vocab, &mut w);
        let records = 4 * ROW_WORDS as u32;
        assert_eq!(masks, records as usize + 10..records as usize + 14);
        assert_eq!(w.len(), masks.end);
        // Masked rows in row order; 0 for the others.
        assert_eq!(w[MASK_AT], records + 10);
        assert_eq!(w[3 * ROW_WORDS + MASK_AT], records + 12);
        assert_eq!(w[ROW_WORDS + MASK_AT], 0);
        assert_eq!(
            &w[2 * ROW_WORDS..3 * ROW_WORDS],
            &[ON_HOST, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let r0 = &w[..ROW_WORDS];
        assert_eq!(r0[0], REPETITION);
        assert_eq!(f32::from_bits(r0[5]), 1.5);
        assert_eq!(&r0[8..13], &[records, 2, 0, 1, 0]);
        let r1 = &w[ROW_WORDS..2 * ROW_WORDS];
        assert_eq!(r1[0], TEMPERATURE | TOP_K | TOP_P | MIN_P | PENDING);
        assert_eq!(
            (f32::from_bits(r1[1]), r1[2], f32::from_bits(r1[3])),
            (0.5, 40, 0.9)
        );
        assert_eq!(f32::from_bits(r1[4]), -3.0);
        assert_eq!(f64::from_bits(r1[6] as u64 | (r1[7] as u64) << 32), 0.75);
        assert_eq!(&r1[8..13], &[records + 6, 0, 1, 0, 1]);
        assert_eq!(
            (f32::from_bits(r1[13]), f32::from_bits(r1[14])),
            (0.25, 0.5)
        );
        assert_eq!((r0[13], r0[14]), (0, 0));
        let edits = &w[4 * ROW_WORDS..masks.start];
        let bits = |v: f32| v.to_bits();
        assert_eq!(edits, &[4, 0, 9, 0, 2, bits(0.5), 7, bits(0.25), 0, 0]);
    }
}
