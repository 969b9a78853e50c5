//! Tokenization: HF tokenizer.json, chat templates, streaming detokenizer.
