//! Tokenization, detokenization and chat templates.

use super::alloc::{alloc_string, alloc_tokens};
use super::args;
use super::boundary::ffi_call;
use super::model::ni_model;
use super::status::ni_status;
use crate::tokenizer::ChatMessage;
use std::ffi::c_char;

/// One chat message: NUL-terminated UTF-8 `role` ("system", "user",
/// "assistant", ...) and `content`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_chat_message {
    pub role: *const c_char,
    pub content: *const c_char,
}

/// Writes a library-owned string and its optional length.
fn write_string(s: &str, out_text: *mut *mut c_char, out_len: *mut usize) -> crate::Result<()> {
    let out = args::out_ptr(out_text, "out_text")?;
    let ptr = alloc_string(s.as_bytes())?;
    // SAFETY: out was checked; out_len is NULL or points to a size_t (contract).
    unsafe {
        out.write(ptr);
        if !out_len.is_null() {
            out_len.write(s.len());
        }
    }
    Ok(())
}

/// Token ids of `text_len` bytes of UTF-8 `text` (no NUL needed). With
/// `add_special_tokens` the tokenizer's post-processor tokens (e.g. BOS) are
/// added, as transformers' `encode` does by default; text produced by
/// `ni_apply_chat_template` already holds them, so pass false for it.
///
/// On success `*out_tokens` receives an array of `*out_count` ids, to be
/// freed with `ni_tokens_free` (NULL when the count is 0). Fails with
/// `NI_ERR_INVALID_ARGUMENT` for invalid UTF-8, a model without tokenizer,
/// or text that cannot fit in the model's context: longer than
/// `context_length` × the tokenizer's longest token in bytes (refused
/// before tokenizing, which costs about a hundred bytes of memory per byte
/// of text; split longer documents).
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_tokenize(
    model: *const ni_model,
    text: *const c_char,
    text_len: usize,
    add_special_tokens: bool,
    out_tokens: *mut *mut u32,
    out_count: *mut usize,
) -> ni_status {
    ffi_call("ni_tokenize", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        // SAFETY: per this function's contract.
        let text = unsafe { args::text(text, text_len, "text")? };
        let out = args::out_ptr(out_tokens, "out_tokens")?;
        let out_n = args::out_ptr(out_count, "out_count")?;
        let context = m.model.config().max_position_embeddings;
        let ids = m
            .model
            .tokenizer()?
            .encode_bounded(text, add_special_tokens, context, "text")?;
        let ptr = alloc_tokens(&ids)?;
        // SAFETY: both out-parameters were checked.
        unsafe {
            out.write(ptr);
            out_n.write(ids.len());
        }
        Ok(())
    })
}

/// The text of `count` token ids. With `skip_special_tokens` special tokens
/// (like `<|im_end|>`) are left out.
///
/// On success `*out_text` receives a NUL-terminated UTF-8 string to be freed
/// with `ni_string_free`, and `*out_len` (if `out_len` is not NULL) its
/// length in bytes. Fails with `NI_ERR_INVALID_ARGUMENT` when an id is not
/// in the vocabulary.
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_detokenize(
    model: *const ni_model,
    tokens: *const u32,
    count: usize,
    skip_special_tokens: bool,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> ni_status {
    ffi_call("ni_detokenize", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        // SAFETY: per this function's contract.
        let ids = unsafe { args::slice(tokens, count, "tokens")? };
        args::out_ptr(out_text, "out_text")?;
        let text = m.model.tokenizer()?.decode(ids, skip_special_tokens)?;
        write_string(&text, out_text, out_len)
    })
}

/// Renders `count` messages with the model's chat template, the way
/// transformers' `apply_chat_template(..., tokenize=False)` does. With
/// `add_generation_prompt` the text ends with the assistant turn's opening.
/// Tokenize the result with `add_special_tokens = false`.
///
/// On success `*out_text` receives a NUL-terminated string to be freed with
/// `ni_string_free`, and `*out_len` (if not NULL) its length in bytes.
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_apply_chat_template(
    model: *const ni_model,
    messages: *const ni_chat_message,
    count: usize,
    add_generation_prompt: bool,
    out_text: *mut *mut c_char,
    out_len: *mut usize,
) -> ni_status {
    ffi_call("ni_apply_chat_template", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        // SAFETY: per this function's contract.
        let raw = unsafe { args::slice(messages, count, "messages")? };
        args::out_ptr(out_text, "out_text")?;
        let mut msgs = Vec::with_capacity(raw.len());
        for (i, msg) in raw.iter().enumerate() {
            // SAFETY: each message holds NUL-terminated strings (contract).
            let role = unsafe { args::cstr(msg.role, &format!("messages[{i}].role"))? };
            // SAFETY: as above.
            let content = unsafe { args::cstr(msg.content, &format!("messages[{i}].content"))? };
            msgs.push(ChatMessage::new(role, content));
        }
        let text = m
            .model
            .tokenizer()?
            .apply_chat_template(&msgs, add_generation_prompt)?;
        write_string(&text, out_text, out_len)
    })
}
