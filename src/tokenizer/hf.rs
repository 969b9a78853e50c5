//! The tokenizer of a Hugging Face model directory.

use super::added::{AddedTokens, Keep};
use super::chat::{ChatMessage, ChatTemplate};
use super::config::{SpecialTokens, TemplateSource, TokenizerConfig};
use super::protect::{self, ProtectedText};
use crate::{bail_arg, untrusted_file, Error, Result};
use std::collections::HashSet;
use std::ops::Range;
use std::path::Path;
use tokenizers::PostProcessor;

pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Runs a call into the `tokenizers` crate and turns a panic into an error
/// message: it `expect`s on some malformed input (0.22 panics while
/// deserializing a `tokenizer.json` whose "decoder" does not parse, found by
/// fuzz/tokenizer_json), and a library must not unwind into its caller. The
/// tokenizer is immutable, so nothing is left half-updated.
fn contain<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        format!("the tokenizers library panicked: {what}")
    })
}

/// How [`Tokenizer::encode_with`] treats its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add the post-processor's tokens (e.g. BOS), as transformers' `encode`
    /// does by default.
    pub add_special_tokens: bool,
    /// Read special-token text in the input (`<|im_end|>`) as that special
    /// token. False tokenizes it as ordinary text, exactly as transformers
    /// with `split_special_tokens=True`: use false for text from users, which
    /// must not be able to end a turn or open one. Added tokens that are not
    /// special are matched either way, as there.
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    /// What [`Tokenizer::encode`] does: no added tokens, special text parsed.
    fn default() -> Self {
        EncodeOptions {
            add_special_tokens: false,
            parse_special: true,
        }
    }
}

enum ChatSlot {
    None,
    Ready(Box<ChatTemplate>),
    NoDefault(Vec<String>),
}

/// `tokenizer.json` + `tokenizer_config.json` (+ chat template files). Immutable after
/// loading and safe to share between threads.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest token id (model vocab and added tokens).
    vocab_size: usize,
    /// Set only when some id below `vocab_size` has no token.
    valid_ids: Option<Vec<bool>>,
    /// Added tokens marked special: dropped by `decode(.., skip_special_tokens = true)`.
    special_ids: HashSet<u32>,
    special: SpecialTokens,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// BOS/EOS that the config asks for but the post-processor does not add.
    extra_bos: Option<u32>,
    extra_eos: Option<u32>,
    /// The most bytes of text one token can stand for (see `min_tokens`).
    max_bytes_per_token: usize,
    chat: ChatSlot,
    /// The added tokens, for encoding with only some special matches counted.
    added: AddedTokens,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .field("has_chat_template", &self.has_chat_template())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads the tokenizer files of a model directory. `tokenizer.json` is required;
    /// `tokenizer_config.json`, `chat_template.json` and `chat_template.jinja` are optional.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join(TOKENIZER_FILE);
        let bytes = untrusted_file::read(&path, untrusted_file::MAX_TOKENIZER_BYTES)?;
        let inner = contain(|| tokenizers::Tokenizer::from_bytes(&bytes))
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| {
                Error::invalid_model(format!("{} is not a valid tokenizer: {e}", path.display()))
            })?;
        let config = TokenizerConfig::load(dir)?;
        Self::new(inner, config, dir)
    }

    fn new(inner: tokenizers::Tokenizer, config: TokenizerConfig, dir: &Path) -> Result<Tokenizer> {
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let valid_ids = (vocab.len() != vocab_size).then(|| {
            let mut valid = vec![false; vocab_size];
            for &id in vocab.values() {
                valid[id as usize] = true;
            }
            valid
        });
        let added = AddedTokens::new(&inner).map_err(|e| {
            Error::invalid_model(format!("{}: {e}", dir.join(TOKENIZER_FILE).display()))
        })?;
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();

        let special = config.special;
        let lookup = |name: &str, token: &Option<String>| -> Result<Option<u32>> {
            match token {
                None => Ok(None),
                Some(t) => match inner.token_to_id(t) {
                    Some(id) => Ok(Some(id)),
                    None => Err(Error::invalid_model(format!(
                        "{}: {name} {t:?} is not in the vocabulary of {TOKENIZER_FILE}",
                        dir.join(super::config::CONFIG_FILE).display()
                    ))),
                },
            }
        };
        let bos_id = lookup("bos_token", &special.bos)?;
        let eos_id = lookup("eos_token", &special.eos)?;
        // transformers rebuilds some post-processors from add_bos_token/add_eos_token; we
        // trust tokenizer.json's post-processor and add the token only when it adds none.
        let pp_adds = inner
            .get_post_processor()
            .map_or(0, |pp| pp.added_tokens(false));
        let extra_bos = if config.add_bos_token == Some(true) && pp_adds == 0 {
            bos_id
        } else {
            None
        };
        let extra_eos = if config.add_eos_token == Some(true) && pp_adds == 0 {
            eos_id
        } else {
            None
        };

        // Vocabulary strings spell the text they cover at least as long as
        // it is (byte-level: one char per byte; metaspace: "▁" for " ";
        // byte fallback: "<0x41>" for one byte). A normalizer may shorten
        // text before the model sees it (NFC composition, NFKC's fullwidth
        // forms): at most 3 bytes become 1, so allow 4.
        let longest = vocab.keys().map(String::len).max().unwrap_or(1).max(1);
        let max_bytes_per_token = if inner.get_normalizer().is_some() {
            longest.saturating_mul(4)
        } else {
            longest
        };
        let chat = match config.chat_template {
            TemplateSource::None => ChatSlot::None,
            TemplateSource::NoDefault { names } => ChatSlot::NoDefault(names),
            TemplateSource::Text { source, origin } => {
                let origin = dir.join(&origin).display().to_string();
                ChatSlot::Ready(Box::new(ChatTemplate::new(
                    &source,
                    &origin,
                    special.clone(),
                )?))
            }
        };
        let tok = Tokenizer {
            inner,
            vocab_size,
            valid_ids,
            special_ids,
            special,
            bos_id,
            eos_id,
            extra_bos,
            extra_eos,
            max_bytes_per_token,
            chat,
            added,
        };
        // The post-processor's own tokens (a BOS template) come out of
        // every encode: one that names an id without a token is refused
        // here, with the file, rather than at the first request.
        tok.encode("", true).map_err(|e| {
            Error::invalid_model(format!(
                "{}: {}",
                dir.join(TOKENIZER_FILE).display(),
                e.message
            ))
        })?;
        Ok(tok)
    }

    /// Token ids of `text`. With `add_special_tokens` the post-processor's tokens
    /// (e.g. BOS) are added, as in transformers' `encode`. Special tokens written in
    /// the text (like `<|im_start|>`) are recognised as such: never pass text
    /// from users here (see [`Tokenizer::encode_with`]).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode_keeping(text, add_special_tokens, None)
    }

    /// Token ids of `text`, treated as `options` say.
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Result<Vec<u32>> {
        let keep = (!options.parse_special).then_some(Keep::NoSpecial);
        self.encode_keeping(text, options.add_special_tokens, keep)
    }

    /// Token ids of `text` in which special-token text that overlaps one of
    /// `protected` (sorted, disjoint byte ranges) is ordinary text; the rest
    /// is read as [`Tokenizer::encode`] reads it.
    pub fn encode_protected(
        &self,
        text: &str,
        protected: &[Range<usize>],
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        if protected.windows(2).any(|w| w[0].end > w[1].start)
            || protected
                .iter()
                .any(|r| r.start > r.end || r.end > text.len())
        {
            bail_arg!("protected ranges must be sorted, disjoint and inside the text");
        }
        let keep = (!protected.is_empty()).then_some(Keep::OutsideOf(protected));
        self.encode_keeping(text, add_special_tokens, keep)
    }

    /// `keep` None: the `tokenizers` crate's own encoding, every special
    /// match counted.
    fn encode_keeping(
        &self,
        text: &str,
        add_special_tokens: bool,
        keep: Option<Keep<'_>>,
    ) -> Result<Vec<u32>> {
        let encoding = contain(|| match keep {
            Some(keep) if self.added.has_special() => {
                self.added
                    .encode(&self.inner, text, add_special_tokens, keep)
            }
            _ => self.inner.encode_fast(text, add_special_tokens),
        })
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|e| Error::invalid_arg(format!("cannot tokenize text: {e}")))?;
        let ids = encoding.get_ids();
        // A hostile tokenizer.json can make ids its vocabulary lacks (a
        // post-processor or unknown token naming an id no token has):
        // they would reach the model as tokens that decode to nothing.
        if let Some(&bad) = ids.iter().find(|&&id| self.check_id(id).is_err()) {
            return Err(Error::invalid_arg(format!(
                "cannot tokenize text: the tokenizer produced id {bad}, which has no token in its \
                 vocabulary (a post-processor or unknown token naming a missing id)"
            )));
        }
        if !add_special_tokens || (self.extra_bos.is_none() && self.extra_eos.is_none()) {
            return Ok(ids.to_vec());
        }
        let mut out = Vec::with_capacity(ids.len() + 2);
        out.extend(self.extra_bos);
        out.extend_from_slice(ids);
        out.extend(self.extra_eos);
        Ok(out)
    }

    /// The most bytes of text one token of this tokenizer covers: text of
    /// `n` bytes encodes to at least `ceil(n / max_bytes_per_token)` tokens.
    /// (A tokenizer that drops input, such as a whitespace pre-tokenizer,
    /// can beat the bound; the causal LM tokenizers this engine loads keep
    /// every byte.)
    pub fn max_bytes_per_token(&self) -> usize {
        self.max_bytes_per_token
    }

    /// The longest text (in bytes) that may encode to `max_tokens` tokens or fewer.
    pub fn max_text_bytes(&self, max_tokens: usize) -> usize {
        max_tokens.saturating_mul(self.max_bytes_per_token)
    }

    /// `encode`, refusing up front (without tokenizing) text too long to
    /// encode to `max_tokens` tokens or fewer: tokenizing costs time and
    /// about a hundred bytes of memory per byte of text, so a prompt far
    /// beyond the context must not be tokenized just to be refused. `what`
    /// names the text in the error.
    pub fn encode_bounded(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_tokens: usize,
        what: &str,
    ) -> Result<Vec<u32>> {
        self.check_text_len(text, max_tokens, what)?;
        self.encode(text, add_special_tokens)
    }

    /// `encode_with`, refusing too long text up front as `encode_bounded` does.
    pub fn encode_bounded_with(
        &self,
        text: &str,
        options: EncodeOptions,
        max_tokens: usize,
        what: &str,
    ) -> Result<Vec<u32>> {
        self.check_text_len(text, max_tokens, what)?;
        self.encode_with(text, options)
    }

    /// Fails when `text` cannot encode to `max_tokens` tokens or fewer.
    fn check_text_len(&self, text: &str, max_tokens: usize, what: &str) -> Result<()> {
        if text.len() > self.max_text_bytes(max_tokens) {
            bail_arg!(
                "{what} is {} bytes long: at least {} tokens (a token of this tokenizer covers at \
                 most {} bytes), more than the limit of {max_tokens} tokens (the model's context \
                 length; at most {} bytes of text)",
                text.len(),
                text.len().div_ceil(self.max_bytes_per_token),
                self.max_bytes_per_token,
                self.max_text_bytes(max_tokens)
            );
        }
        Ok(())
    }

    /// Text of `ids`; every id must be in the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_unchecked(ids, skip_special_tokens)
    }

    pub(crate) fn decode_unchecked(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String> {
        contain(|| self.inner.decode(ids, skip_special_tokens))
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| Error::internal(format!("cannot decode token ids: {e}")))
    }

    /// Fails with a clear error when `id` is not a token of this tokenizer.
    pub fn check_id(&self, id: u32) -> Result<()> {
        let idx = id as usize;
        if idx >= self.vocab_size {
            bail_arg!(
                "token id {id} is out of range: the vocabulary has {} ids",
                self.vocab_size
            );
        }
        if let Some(valid) = &self.valid_ids {
            if !valid[idx] {
                bail_arg!("token id {id} has no token in the vocabulary");
            }
        }
        Ok(())
    }

    /// One past the largest token id, added tokens included: the size a model's
    /// embedding and logits must cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// How many ids from 0 up all have a token: the ids below this decode
    /// to text, the first one past it does not.
    pub fn covered_ids(&self) -> usize {
        match &self.valid_ids {
            None => self.vocab_size,
            Some(valid) => valid.iter().position(|&v| !v).unwrap_or(valid.len()),
        }
    }

    /// Id of a token string (vocabulary or added token), e.g. `"<|im_end|>"`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The `tokenizers` object, for this module's siblings.
    pub(super) fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token string of an id, as stored in the vocabulary (not decoded text).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token marked special (skipped when decoding with
    /// `skip_special_tokens`).
    pub fn is_special_id(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn has_chat_template(&self) -> bool {
        matches!(self.chat, ChatSlot::Ready(_))
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        match &self.chat {
            ChatSlot::Ready(t) => Some(t),
            _ => None,
        }
    }

    /// Renders a conversation with the model's chat template. The result already holds
    /// the template's special tokens: encode it with `add_special_tokens = false`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.template()?.render(messages, add_generation_prompt)
    }

    fn template(&self) -> Result<&ChatTemplate> {
        match &self.chat {
            ChatSlot::Ready(t) => Ok(t),
            ChatSlot::None => bail_arg!("this tokenizer has no chat template"),
            ChatSlot::NoDefault(names) => bail_arg!(
                "the tokenizer config has named chat templates {names:?} but none named \"default\""
            ),
        }
    }

    /// Renders a conversation as [`Tokenizer::apply_chat_template`] does and
    /// says which bytes of the result are message text that must stay text
    /// (see `protect`): encode it with [`Tokenizer::encode_protected`].
    pub fn apply_chat_template_protected(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<ProtectedText> {
        let template = self.template()?;
        protect::render(template, messages, add_generation_prompt, |text| {
            self.added.special_spans(&self.inner, text)
        })
    }

    /// Token ids of a conversation rendered with the chat template, as
    /// transformers' `apply_chat_template(..., tokenize=True)` gives them,
    /// except that special-token text inside the messages (roles and
    /// contents) is ordinary text: only the template's own special tokens are
    /// special, so a message cannot end its turn or forge another. Refuses a
    /// rendering too long to encode to `max_tokens` tokens before tokenizing.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>> {
        let rendered = self.apply_chat_template_protected(messages, add_generation_prompt)?;
        self.check_text_len(&rendered.text, max_tokens, "the rendered conversation")?;
        self.encode_protected(&rendered.text, &rendered.protected, false)
    }
}
