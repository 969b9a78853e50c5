//! `nanoinfer perplexity`: exp of the mean next-token negative log-likelihood
//! over the first N tokens of a file (what transformers computes with
//! `labels=input_ids`).

use crate::args::Args;
use crate::session_opts::{load_model, MODEL_OPTS};
use nanoinfer::engine::eval::perplexity;
use nanoinfer::untrusted_file;
use serde_json::json;
use std::fs::File;
use std::io::Read;
use std::path::Path;

pub const FLAGS: &[&str] = &["json"];

pub fn run(a: &Args) -> Result<(), String> {
    a.check_known(&[MODEL_OPTS, FLAGS, &["file", "max-tokens"]].concat())?;
    let path = a.get("file").ok_or("--file PATH is required")?;
    let max_tokens: usize = a.parse_or("max-tokens", 1024)?;
    // Opened as untrusted input (a FIFO or device is refused, not read);
    // only the prefix that can matter is read below.
    let file = untrusted_file::open(Path::new(path)).map_err(|e| format!("--file: {e}"))?;
    let model = load_model(a)?;
    let context = model.config().max_position_embeddings;
    if max_tokens > context {
        return Err(format!(
            "--max-tokens {max_tokens} exceeds the model's context length {context}"
        ));
    }
    let tok = model.tokenizer().map_err(|e| e.to_string())?;
    // Only the start of the file can matter: text of twice the bytes that
    // --max-tokens tokens can cover holds at least twice as many tokens, so
    // cutting the file there changes none of the first --max-tokens.
    let limit = tok.max_text_bytes(max_tokens.saturating_mul(2).saturating_add(1));
    let text = read_prefix(file, limit).map_err(|e| format!("cannot read --file {path}: {e}"))?;
    let mut ids = tok.encode(&text, true).map_err(|e| e.to_string())?;
    ids.truncate(max_tokens);
    let ppl = perplexity(&model, &ids).map_err(|e| e.to_string())?;
    if a.flag("json") {
        println!("{}", json!({"ppl": ppl, "n_tokens": ids.len()}));
    } else {
        println!("perplexity {ppl:.4} over {} tokens", ids.len());
    }
    Ok(())
}

/// The first `limit` bytes of `file` as UTF-8; a character cut at the end
/// is dropped.
fn read_prefix(file: File, limit: usize) -> std::io::Result<String> {
    let mut bytes = Vec::new();
    file.take(limit as u64).read_to_end(&mut bytes)?;
    match String::from_utf8(bytes) {
        Ok(text) => Ok(text),
        Err(e) if e.utf8_error().error_len().is_none() && e.as_bytes().len() == limit => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            Ok(String::from_utf8(bytes).expect("the valid prefix"))
        }
        Err(e) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
    }
}
