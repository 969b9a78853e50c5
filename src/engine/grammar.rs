//! Compiling a request's structured-output constraint (JSON Schema, regex,
//! Lark grammar, list of choices) into the llguidance matcher its sampler
//! masks with. One compiler per session, built at the first constrained
//! request: it holds the token trie of the model's vocabulary.

use super::model::Model;
use super::request::Constraint;
use crate::sampling::GrammarMask;
use crate::tokenizer::{EncodeOptions, TokenBytes};
use crate::{bail_arg, Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// Largest constraint text (schema, regex, grammar, all choices together).
pub const MAX_CONSTRAINT_BYTES: usize = 1 << 20;
/// Most choices of a `Choice` constraint.
pub const MAX_CHOICES: usize = 4096;

pub struct GrammarCompiler {
    factory: ParserFactory,
}

/// The model's vocabulary as llguidance sees it: the token trie, and the
/// model's tokenizer for the text a grammar forces.
struct ModelTokEnv {
    trie: TokTrie,
    model: Arc<Model>,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text the grammar forces is ordinary text: special-token text in it
    /// (a choice containing "<|im_end|>") must not become the special
    /// token, whose bytes in the trie are not that text, so the grammar
    /// would allow a token it then cannot advance by.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let plain = EncodeOptions {
            add_special_tokens: false,
            parse_special: false,
        };
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.model
                .tokenizer()
                .and_then(|t| t.encode_with(text, plain))
                .unwrap_or_default()
        })
    }
}

impl GrammarCompiler {
    pub fn new(model: &Arc<Model>) -> Result<GrammarCompiler> {
        let tok = model.tokenizer().map_err(|e| {
            Error::invalid_arg(format!(
                "structured output needs the model's tokenizer: {}",
                e.message
            ))
        })?;
        let vocab = model.config().vocab_size.max(tok.vocab_size());
        let mut words: Vec<Vec<u8>> = tok
            .token_bytes()?
            .into_iter()
            .enumerate()
            .map(|(id, t)| match t {
                TokenBytes::Text(b) if !b.is_empty() => b,
                TokenBytes::Special(name) => special_word(&name),
                // No text: a placeholder the grammar never matches.
                _ => special_word(&format!("<[{id}]>")),
            })
            .collect();
        while words.len() < vocab {
            words.push(special_word(&format!("<[{}]>", words.len())));
        }
        let eos = model.eos_token_ids.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if model.eos_token_ids.len() > 1 {
            trie = trie.with_eos_tokens(&model.eos_token_ids);
        }
        let env: TokEnv = Arc::new(ModelTokEnv {
            trie,
            model: model.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::internal(format!("structured output: {e}")))?;
        // Grammar warnings go nowhere: a library must not write to stderr
        // (the problems that matter come back as errors).
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// The mask for `constraint`, or an error naming what is wrong with it.
    pub fn compile(&self, constraint: &Constraint) -> Result<GrammarMask> {
        let grammar = grammar_of(constraint)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| Error::invalid_arg(format!("{}: {e}", constraint.kind())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail_arg!("{}: {e}", constraint.kind());
        }
        Ok(GrammarMask::new(matcher))
    }
}

fn special_word(name: &str) -> Vec<u8> {
    let mut w = Vec::with_capacity(name.len() + 1);
    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
    w.extend_from_slice(name.as_bytes());
    w
}

/// Checks the constraint's size and shape and turns it into llguidance's
/// grammar.
fn grammar_of(c: &Constraint) -> Result<TopLevelGrammar> {
    let bytes = match c {
        Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Lark(s) => s.len(),
        Constraint::Choice(v) => v.iter().map(String::len).sum(),
    };
    if bytes > MAX_CONSTRAINT_BYTES {
        bail_arg!(
            "{} is {bytes} bytes long, more than the limit of {MAX_CONSTRAINT_BYTES}",
            c.kind()
        );
    }
    Ok(match c {
        Constraint::JsonSchema(s) => {
            let mut schema: serde_json::Value = serde_json::from_str(s)
                .map_err(|e| Error::invalid_arg(format!("json_schema is not valid JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                bail_arg!("json_schema must be a JSON object (or true/false)");
            }
            // No whitespace between JSON tokens unless the schema's own
            // `x-guidance` options allow it (`whitespace_flexible` or a
            // `whitespace_pattern`): with it free, a small model
            // pretty-prints (SmolLM2 greedy ran out of 40 tokens inside
            // newlines and indentation) and a sampled one can spend its
            // whole budget on spaces.
            if let Some(obj) = schema.as_object_mut() {
                let options = obj
                    .entry("x-guidance")
                    .or_insert_with(|| serde_json::json!({}));
                if let Some(options) = options.as_object_mut() {
                    options
                        .entry("whitespace_flexible")
                        .or_insert(serde_json::Value::Bool(false));
                }
            }
            TopLevelGrammar::from_json_schema(schema)
        }
        Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        Constraint::Choice(choices) => {
            if choices.is_empty() || choices.len() > MAX_CHOICES {
                bail_arg!(
                    "choice needs 1 to {MAX_CHOICES} alternatives, got {}",
                    choices.len()
                );
            }
            if choices.iter().any(String::is_empty) {
                bail_arg!("choice alternatives must not be empty");
            }
            let alternation: Vec<String> = choices.iter().map(|s| regex::escape(s)).collect();
            TopLevelGrammar::from_regex(&format!("({})", alternation.join("|")))
        }
    })
}
