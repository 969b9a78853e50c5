//! A context limited to the first ids of its logits rows (a vocabulary
//! padded past its tokenizer, `ContextShape::sample_vocab`) chooses only
//! among them, on every path a device picks tokens by itself: the plain
//! greedy argmax and, where the device samples, greedy and drawn rows.

use nanoinfer::engine::Model;
use nanoinfer::forward::{AttnSeq, DeviceSampling, RowSampling};
use nanoinfer::kv::KvMapping;
use nanoinfer::memory::MemoryPoolKind;
use nanoinfer::model::{ContextShape, ForwardBatch};
use nanoinfer::sampling::processors::argmax as first_argmax;
use std::sync::Arc;

/// Four sequences of `PROMPT` tokens, prefilled in one forward, with the
/// last row of each wanting a token.
const SEQS: usize = 4;
const PROMPT: usize = 5;

/// Runs the prefill in a fresh context of `shape`; `out` gets the context
/// and the batch, and returns what it computes.
fn with_prefill<T>(
    model: &Arc<Model>,
    shape: &ContextShape,
    out: impl FnOnce(&mut dyn nanoinfer::model::ForwardContext, &ForwardBatch<'_>) -> T,
) -> T {
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..(SEQS * PROMPT) as u32)
        .map(|i| 1 + (i * 7919) % (vocab - 1))
        .collect();
    let slots: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| (1 + (s * PROMPT) as u32..1 + ((s + 1) * PROMPT) as u32).collect())
        .collect();
    let seqs: Vec<AttnSeq<'_>> = slots
        .iter()
        .enumerate()
        .map(|(s, slots)| AttnSeq {
            start: s * PROMPT,
            len: PROMPT,
            context_len: 0,
            kv: KvMapping::Slots(slots),
        })
        .collect();
    let logits_rows: Vec<usize> = (1..=SEQS).map(|s| s * PROMPT - 1).collect();
    let batch = ForwardBatch {
        tokens: &tokens,
        seqs: &seqs,
        logits_rows: &logits_rows,
        stop: None,
    };
    let mut ctx = model.decoder.clone().new_context(shape).unwrap();
    out(&mut *ctx, &batch)
}

/// Checks the limit on `model`'s device with contexts from `pool`: the
/// cut is placed below the unlimited argmax of some rows (which must then
/// choose the best id under the cut) and of every row.
pub fn check_choosable_ids(model: &Arc<Model>, pool: MemoryPoolKind) {
    let vocab = model.config().vocab_size;
    let mut shape = ContextShape::new(SEQS * PROMPT + 1, SEQS * PROMPT, SEQS);
    shape.memory_pool = pool;
    let logits = with_prefill(model, &shape, |ctx, batch| {
        let mut logits = vec![0f32; SEQS * vocab];
        ctx.forward(batch, &mut logits).unwrap();
        logits
    });
    let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
    let unlimited: Vec<u32> = rows.iter().map(|r| first_argmax(r)).collect();
    let highest = *unlimited.iter().max().unwrap() as usize;
    let lowest = *unlimited.iter().min().unwrap() as usize;
    assert!(lowest > 0, "a row's argmax is id 0: {unlimited:?}");
    for cut in [highest, lowest] {
        shape.sample_vocab = Some(cut);
        let want: Vec<u32> = rows.iter().map(|r| first_argmax(&r[..cut])).collect();
        let got = with_prefill(model, &shape, |ctx, batch| {
            let mut ids = vec![0u32; SEQS];
            ctx.forward_argmax(batch, &mut ids).unwrap();
            ids
        });
        assert_eq!(
            got, want,
            "argmax limited to ids below {cut} (unlimited: {unlimited:?})"
        );
        let samples_on_device = with_prefill(model, &shape, |ctx, _| ctx.samples_on_device());
        if !samples_on_device {
            continue;
        }
        // Greedy rows, and draws at a temperature that makes the padded
        // winners far likelier than any other id were they allowed.
        let mut sampling = DeviceSampling::default();
        for r in 0..SEQS {
            sampling.rows.push(if r % 2 == 0 {
                RowSampling::greedy()
            } else {
                RowSampling {
                    temperature: Some(0.05),
                    u: (r as f64 + 0.5) / SEQS as f64,
                    ..RowSampling::greedy()
                }
            });
        }
        let got = with_prefill(model, &shape, |ctx, batch| {
            let mut ids = vec![0u32; SEQS];
            ctx.forward_sample(batch, &sampling, &mut |_| {}, &mut ids, &mut [])
                .unwrap();
            ids
        });
        for (r, (&id, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (id as usize) < cut,
                "sampled row {r} chose id {id}, past the cut {cut}"
            );
            if r % 2 == 0 {
                assert_eq!(id, w, "greedy sampled row {r} under the cut {cut}");
            }
        }
    }
}
