//! Tokenization: HF tokenizer.json, chat templates, streaming detokenizer.
//!
//! - [`Tokenizer::from_dir`] loads `tokenizer.json` (required), `tokenizer_config.json`
//!   (special tokens, `add_bos_token`/`add_eos_token`, `chat_template`) and
//!   `chat_template.json` / `chat_template.jinja` when present.
//! - [`Tokenizer::apply_chat_template`] renders a conversation as transformers does
//!   (Jinja2 semantics, Python value formatting, `tojson`, `raise_exception`,
//!   `strftime_now`). Encode the result with `add_special_tokens = false`.
//! - [`Tokenizer::encode_with`] with `parse_special = false` reads special-token
//!   text (`<|im_end|>`) as plain text, as transformers' `split_special_tokens=True`.
//! - [`Tokenizer::encode_chat`] renders and tokenizes a conversation with its
//!   messages' text kept plain: only the template writes special tokens.
//! - [`StreamDetokenizer`] turns generated ids into UTF-8-safe text deltas.

mod added;
mod chat;
mod config;
mod hf;
mod protect;
mod pyfmt;
mod sandbox;
mod stream;
mod token_bytes;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::SpecialTokens;
pub use hf::{EncodeOptions, Tokenizer};
pub use protect::ProtectedText;
pub use sandbox::fuel_for as template_step_limit;
pub use stream::StreamDetokenizer;
pub use token_bytes::TokenBytes;
