//! `nanoinfer perplexity`: exp of the mean next-token negative log-likelihood
//! over the first N tokens of a file (what transformers computes with
//! `labels=input_ids`).

use crate::args::Args;
use crate::session_opts::{load_model, MODEL_OPTS};
use nanoinfer::backend::cpu::attention::AttnSeq;
use nanoinfer::kv::{KvMapping, KvStorage};
use nanoinfer::model::{ForwardBatch, Workspace};
use serde_json::json;

pub const FLAGS: &[&str] = &["json"];
/// Rows per forward pass; bounds the logits buffer.
const CHUNK: usize = 128;

pub fn run(a: &Args) -> Result<(), String> {
    a.check_known(&[MODEL_OPTS, FLAGS, &["file", "max-tokens"]].concat())?;
    let path = a.get("file").ok_or("--file PATH is required")?;
    let max_tokens: usize = a.parse_or("max-tokens", 1024)?;
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read --file {path}: {e}"))?;
    let model = load_model(a)?;
    let mut ids = model
        .tokenizer()
        .and_then(|t| t.encode(&text, true))
        .map_err(|e| e.to_string())?;
    ids.truncate(max_tokens);
    let ppl = perplexity(&model, &ids)?;
    if a.flag("json") {
        println!("{}", json!({"ppl": ppl, "n_tokens": ids.len()}));
    } else {
        println!("perplexity {ppl:.4} over {} tokens", ids.len());
    }
    Ok(())
}

pub fn perplexity(model: &nanoinfer::engine::Model, ids: &[u32]) -> Result<f64, String> {
    if ids.len() < 2 {
        return Err("perplexity needs at least 2 tokens".into());
    }
    let c = model.config();
    let vocab = c.vocab_size;
    let mut kv = KvStorage::new(c.num_layers, ids.len() + 1, c.num_kv_heads, c.head_dim);
    let slots: Vec<u32> = (1..=ids.len() as u32).collect();
    let mut ws = Workspace::default();
    let mut logits = vec![0f32; CHUNK * vocab];
    let mut nll = 0f64;
    for start in (0..ids.len() - 1).step_by(CHUNK) {
        let len = CHUNK.min(ids.len() - 1 - start);
        let seqs = [AttnSeq {
            start: 0,
            len,
            context_len: start,
            kv: KvMapping::Slots(&slots),
        }];
        let rows: Vec<usize> = (0..len).collect();
        let batch = ForwardBatch {
            tokens: &ids[start..start + len],
            seqs: &seqs,
            logits_rows: &rows,
        };
        model
            .decoder
            .forward(&model.pool, &batch, &mut kv, &mut ws, &mut logits)
            .map_err(|e| e.to_string())?;
        for r in 0..len {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[ids[start + r + 1] as usize] as f64;
        }
    }
    Ok((nll / (ids.len() - 1) as f64).exp())
}
