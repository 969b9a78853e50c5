//! `nanoinfer perplexity`: exp of the mean next-token negative log-likelihood
//! over the first N tokens of a file (what transformers computes with
//! `labels=input_ids`).

use crate::args::Args;
use crate::session_opts::{load_model, MODEL_OPTS};
use nanoinfer::engine::eval::perplexity;
use nanoinfer::untrusted_file;
use serde_json::json;
use std::path::Path;

pub const FLAGS: &[&str] = &["json"];

pub fn run(a: &Args) -> Result<(), String> {
    a.check_known(&[MODEL_OPTS, FLAGS, &["file", "max-tokens"]].concat())?;
    let path = a.get("file").ok_or("--file PATH is required")?;
    let max_tokens: usize = a.parse_or("max-tokens", 1024)?;
    let text = untrusted_file::read_text(Path::new(path), untrusted_file::MAX_INPUT_TEXT_BYTES)
        .map_err(|e| format!("--file: {e}"))?;
    let model = load_model(a)?;
    let mut ids = model
        .tokenizer()
        .and_then(|t| t.encode(&text, true))
        .map_err(|e| e.to_string())?;
    ids.truncate(max_tokens);
    let ppl = perplexity(&model, &ids).map_err(|e| e.to_string())?;
    if a.flag("json") {
        println!("{}", json!({"ppl": ppl, "n_tokens": ids.len()}));
    } else {
        println!("perplexity {ppl:.4} over {} tokens", ids.len());
    }
    Ok(())
}
