//! Tokenization, detokenization and chat templates.

use super::alloc::{alloc_string, alloc_tokens};
use super::args;
use super::boundary::ffi_call;
use super::model::ni_model;
use super::status::ni_status;
use crate::tokenizer::{ChatMessage, EncodeOptions};
use crate::{bail_arg, Result};
use std::ffi::c_char;

/// `ni_tokenize_ex` flag: add the tokenizer's post-processor tokens (e.g.
/// BOS), as transformers' `encode` does by default.
pub const NI_TOKENIZE_ADD_SPECIAL: u32 = 1;
/// `ni_tokenize_ex` flag: read special-token text in the input (e.g.
/// `<|im_end|>`) as those special tokens. Without it such text is tokenized
/// as ordinary text (transformers' `split_special_tokens=True`): leave it out
/// for text from users, so that it cannot end a turn or forge one.
pub const NI_TOKENIZE_PARSE_SPECIAL: u32 = 2;

/// One chat message: NUL-terminated UTF-8 `role` ("system", "user",
/// "assistant", ...) and `content`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ni_chat_message {
    pub role: *const c_char,
    pub content: *const c_char,
}

/// Copies `count` C messages into owned ones; `what` names the array in errors.
///
/// # Safety
/// A non-NULL `messages` must point to `count` messages whose strings are
/// NULL or NUL-terminated.
pub(crate) unsafe fn chat_messages(
    messages: *const ni_chat_message,
    count: usize,
    what: &str,
) -> Result<Vec<ChatMessage>> {
    // SAFETY: forwarded contract.
    let raw = unsafe { args::slice(messages, count, what)? };
    let mut msgs = Vec::with_capacity(raw.len());
    for (i, msg) in raw.iter().enumerate() {
        // SAFETY: each message holds NUL-terminated strings (contract).
        let role = unsafe { args::cstr(msg.role, &format!("{what}[{i}].role"))? };
        // SAFETY: as above.
        let content = unsafe { args::cstr(msg.content, &format!("{what}[{i}].content"))? };
        msgs.push(ChatMessage::new(role, content));
    }
    Ok(msgs)
}

/// Writes a library-owned token array and its count.
fn write_tokens(ids: &[u32], out_tokens: *mut *mut u32, out_count: *mut usize) -> Result<()> {
    let out = args::out_ptr(out_tokens, "out_tokens")?;
    let out_n = args::out_ptr(out_count, "out_count")?;
    let ptr = alloc_tokens(ids)?;
    // SAFETY: both out-parameters were checked.
    unsafe {
        out.write(ptr);
        out_n.write(ids.len());
    }
    Ok(())
}

/// Writes a library-owned string and its optional length.
fn write_string(s: &str, out_text: *mut *mut c_char, out_len: *mut usize) -> Result<()> {
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
/// Special-token text in `text` (e.g. `<|im_end|>`) becomes those special
/// tokens: this is `ni_tokenize_ex` with `NI_TOKENIZE_PARSE_SPECIAL`, kept for
/// compatibility. It does not protect user text: text a user typed can close
/// its turn and forge others. Use `ni_tokenize_chat` for conversations and
/// `ni_tokenize_ex` without `NI_TOKENIZE_PARSE_SPECIAL` for raw user text.
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
        let mut flags = NI_TOKENIZE_PARSE_SPECIAL;
        if add_special_tokens {
            flags |= NI_TOKENIZE_ADD_SPECIAL;
        }
        // SAFETY: per this function's contract, which is tokenize's.
        unsafe { tokenize(model, text, text_len, flags, out_tokens, out_count) }
    })
}

/// Token ids of `text_len` bytes of UTF-8 `text` (no NUL needed), as `flags`
/// (a bitwise OR of `NI_TOKENIZE_*`, or 0) say:
/// - `NI_TOKENIZE_ADD_SPECIAL`: add the post-processor's tokens (e.g. BOS);
/// - `NI_TOKENIZE_PARSE_SPECIAL`: read special-token text (`<|im_end|>`) as
///   special tokens. Without it (flags 0: the safe choice for text from
///   users) such text is tokenized as ordinary text, exactly as transformers
///   with `split_special_tokens=True`; added tokens that are not special are
///   matched either way, as there.
///
/// Output, limits and errors as for `ni_tokenize`; unknown flag bits fail
/// with `NI_ERR_INVALID_ARGUMENT`.
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_tokenize_ex(
    model: *const ni_model,
    text: *const c_char,
    text_len: usize,
    flags: u32,
    out_tokens: *mut *mut u32,
    out_count: *mut usize,
) -> ni_status {
    ffi_call("ni_tokenize_ex", || {
        // SAFETY: per this function's contract, which is tokenize's.
        unsafe { tokenize(model, text, text_len, flags, out_tokens, out_count) }
    })
}

/// `ni_tokenize_ex`.
///
/// # Safety
/// As documented on `ni_tokenize_ex`.
unsafe fn tokenize(
    model: *const ni_model,
    text: *const c_char,
    text_len: usize,
    flags: u32,
    out_tokens: *mut *mut u32,
    out_count: *mut usize,
) -> Result<()> {
    let known = NI_TOKENIZE_ADD_SPECIAL | NI_TOKENIZE_PARSE_SPECIAL;
    if flags & !known != 0 {
        bail_arg!(
            "flags {flags:#x} has unknown bits {:#x}: only NI_TOKENIZE_ADD_SPECIAL and \
             NI_TOKENIZE_PARSE_SPECIAL are defined",
            flags & !known
        );
    }
    // SAFETY: per the caller's contract.
    let m = unsafe { args::handle(model, "model")? };
    // SAFETY: per the caller's contract.
    let text = unsafe { args::text(text, text_len, "text")? };
    args::out_ptr(out_tokens, "out_tokens")?;
    args::out_ptr(out_count, "out_count")?;
    let options = EncodeOptions {
        add_special_tokens: flags & NI_TOKENIZE_ADD_SPECIAL != 0,
        parse_special: flags & NI_TOKENIZE_PARSE_SPECIAL != 0,
    };
    let context = m.model.config().max_position_embeddings;
    let ids = m
        .model
        .tokenizer()?
        .encode_bounded_with(text, options, context, "text")?;
    write_tokens(&ids, out_tokens, out_count)
}

/// Token ids of `count` messages rendered with the model's chat template,
/// as transformers' `apply_chat_template(..., tokenize=True)` gives them,
/// except that message text is protected: special-token text inside a
/// role or content (e.g. `<|im_end|>`) is tokenized as ordinary text, so a
/// message cannot close its turn or forge a system or assistant turn, while
/// the special tokens the template writes stay special. Conversations
/// without such text give exactly transformers' ids. With
/// `add_generation_prompt` the prompt ends with the assistant turn's
/// opening. This, or `messages` in `ni_request_params`, is the way to turn
/// untrusted chat text into a prompt; `ni_apply_chat_template` followed by
/// `ni_tokenize` is not.
///
/// On success `*out_tokens` receives an array of `*out_count` ids, to be
/// freed with `ni_tokens_free` (NULL when the count is 0). Fails with
/// `NI_ERR_INVALID_ARGUMENT` for a NULL or invalid UTF-8 string, a model
/// without chat template, a template error, a rendering longer than the
/// context can hold (as for `ni_tokenize`), or a template that cuts apart
/// message text that spells special tokens (which could then not be kept as
/// text).
/// Thread-safety: any thread, concurrently with any other use of the model.
#[no_mangle]
pub unsafe extern "C" fn ni_tokenize_chat(
    model: *const ni_model,
    messages: *const ni_chat_message,
    count: usize,
    add_generation_prompt: bool,
    out_tokens: *mut *mut u32,
    out_count: *mut usize,
) -> ni_status {
    ffi_call("ni_tokenize_chat", || {
        // SAFETY: per this function's contract.
        let m = unsafe { args::handle(model, "model")? };
        // SAFETY: per this function's contract.
        let msgs = unsafe { chat_messages(messages, count, "messages")? };
        args::out_ptr(out_tokens, "out_tokens")?;
        args::out_ptr(out_count, "out_count")?;
        let context = m.model.config().max_position_embeddings;
        let ids = m
            .model
            .tokenizer()?
            .encode_chat(&msgs, add_generation_prompt, context)?;
        write_tokens(&ids, out_tokens, out_count)
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
/// The text does not say which parts came from the messages, so tokenizing
/// it reads special-token text that a message holds as special tokens: a
/// user can close a turn and forge others. For untrusted messages use
/// `ni_tokenize_chat` (or `messages` in `ni_request_params`) instead.
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
        let msgs = unsafe { chat_messages(messages, count, "messages")? };
        args::out_ptr(out_text, "out_text")?;
        let text = m
            .model
            .tokenizer()?
            .apply_chat_template(&msgs, add_generation_prompt)?;
        write_string(&text, out_text, out_len)
    })
}
