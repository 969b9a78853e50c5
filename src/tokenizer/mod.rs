//! Tokenization: HF tokenizer.json, chat templates, streaming detokenizer.

mod chat;
mod config;
mod hf;
mod pyfmt;
mod stream;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::SpecialTokens;
pub use hf::Tokenizer;
pub use stream::StreamDetokenizer;
