//! Encoding with a say over which special tokens written in the text count.
//!
//! The `tokenizers` crate splits text on its added tokens (`<|im_end|>`, ...)
//! before the model sees it, and offers only one switch: every special token
//! matched, or none (`encode_special_tokens`, transformers'
//! `split_special_tokens=True`). Rendering a chat needs a third way: special
//! tokens written by the template count, the same strings inside message
//! text do not. So this module repeats the crate's splitting step (0.22's
//! `AddedVocabulary::extract_and_normalize` and `find_matches`, rule for rule:
//! two passes, on the text as given and on its normalized form, leftmost-
//! longest matching, `single_word`, `lstrip`, `rstrip`) with a filter on the
//! special matches, and then runs the crate's own pre-tokenizer, model and
//! post-processor. With nothing filtered the result equals the crate's
//! `encode` (tests/tokenizer_special.rs checks that on every fixture).

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use regex::Regex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::LazyLock;
use tokenizers::normalizer::Range as TextRange;
use tokenizers::{
    Encoding, Model, NormalizedString, Normalizer, OffsetType, PreTokenizedString, PreTokenizer,
    Token,
};

/// Which special-token matches become special tokens. Added tokens that are
/// not special are matched either way, as transformers does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keep<'a> {
    /// None: their text is tokenized as ordinary text.
    NoSpecial,
    /// Those that do not overlap any of these byte ranges of the input
    /// (sorted, not overlapping).
    OutsideOf(&'a [Range<usize>]),
}

impl Keep<'_> {
    /// Whether a special match covering `span` (bytes of the input) counts.
    fn allows(&self, span: Option<Range<usize>>) -> bool {
        match (self, span) {
            (Keep::NoSpecial, _) => false,
            (Keep::OutsideOf(_), None) => false,
            (Keep::OutsideOf(ranges), Some(span)) => !overlaps(ranges, &span),
        }
    }
}

/// Whether `span` shares a byte with one of the sorted, disjoint `ranges`.
pub(crate) fn overlaps(ranges: &[Range<usize>], span: &Range<usize>) -> bool {
    let first_ending_after = ranges.partition_point(|r| r.end <= span.start);
    !span.is_empty()
        && ranges[first_ending_after..]
            .iter()
            .take_while(|r| r.start < span.end)
            .any(|r| !r.is_empty())
}

#[derive(Debug, Clone, Copy)]
struct Rule {
    special: bool,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
}

/// Patterns of one pass and the token id of each.
struct MatchSet {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl MatchSet {
    fn new(patterns: Vec<(String, u32)>) -> Result<Self, String> {
        let (texts, ids): (Vec<String>, Vec<u32>) = patterns.into_iter().unzip();
        let automaton = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| format!("cannot index the added tokens: {e}"))?;
        Ok(MatchSet { automaton, ids })
    }
}

/// The added tokens of a tokenizer, indexed for splitting.
pub(crate) struct AddedTokens {
    /// Tokens with `normalized: false`, matched on the text as given.
    raw: MatchSet,
    /// Tokens with `normalized: true`, matched (in normalized form) on the normalized text.
    normalized: MatchSet,
    rules: HashMap<u32, Rule>,
    /// Every special token's text as it is matched, for finding them anywhere
    /// in a text (overlapping matches included): on the text as given, and on
    /// its normalized form.
    special_raw: AhoCorasick,
    special_normalized: AhoCorasick,
    /// The raw-matched special texts, for the fragments at a text's edges.
    special_raw_texts: Vec<String>,
}

impl std::fmt::Debug for AddedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddedTokens")
            .field("tokens", &self.rules.len())
            .finish_non_exhaustive()
    }
}

type Inner = tokenizers::Tokenizer;

impl AddedTokens {
    pub(crate) fn new(inner: &Inner) -> Result<Self, String> {
        let vocab = inner.get_added_vocabulary();
        let mut tokens: Vec<(u32, tokenizers::AddedToken)> =
            inner.get_added_tokens_decoder().into_iter().collect();
        tokens.sort_by_key(|(id, _)| *id);
        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        let mut rules = HashMap::new();
        let mut special_raw = Vec::new();
        let mut special_normalized = Vec::new();
        for (id, token) in tokens {
            if token.content.is_empty() {
                continue;
            }
            let special = vocab.is_special_token(&token.content);
            rules.insert(
                id,
                Rule {
                    special,
                    single_word: token.single_word,
                    lstrip: token.lstrip,
                    rstrip: token.rstrip,
                },
            );
            let text = if token.normalized {
                // As the crate does: the pattern is the token's normalized text.
                let mut text = NormalizedString::from(token.content.as_str());
                if let Some(n) = inner.get_normalizer() {
                    n.normalize(&mut text).map_err(|e| {
                        format!("cannot normalize added token {:?}: {e}", token.content)
                    })?;
                }
                text.get().to_string()
            } else {
                token.content.clone()
            };
            if special && !text.is_empty() {
                match token.normalized {
                    true => special_normalized.push(text.clone()),
                    false => special_raw.push(text.clone()),
                }
            }
            if token.normalized {
                normalized.push((text, id));
            } else {
                raw.push((text, id));
            }
        }
        let every_match = |texts: &[String]| {
            AhoCorasickBuilder::new()
                .match_kind(MatchKind::Standard)
                .build(texts)
                .map_err(|e| format!("cannot index the special tokens: {e}"))
        };
        Ok(AddedTokens {
            raw: MatchSet::new(raw)?,
            normalized: MatchSet::new(normalized)?,
            rules,
            special_raw: every_match(&special_raw)?,
            special_normalized: every_match(&special_normalized)?,
            special_raw_texts: special_raw,
        })
    }

    /// Whether the tokenizer has special tokens that text could spell.
    pub(crate) fn has_special(&self) -> bool {
        self.special_raw.patterns_len() + self.special_normalized.patterns_len() > 0
    }

    /// The byte ranges of `text` that could take part in a special-token
    /// match once `text` is placed among other text: every occurrence of a
    /// special token's text (overlapping ones too, and on the normalized
    /// text for tokens matched there), and at each edge of `text` (also once
    /// trimmed of whitespace) the longest piece that could complete a
    /// special token together with text outside it. Sorted and merged.
    pub(crate) fn special_spans(&self, inner: &Inner, text: &str) -> Vec<Range<usize>> {
        let mut spans: Vec<Range<usize>> = self
            .special_raw
            .find_overlapping_iter(text)
            .map(|m| m.range())
            .collect();
        if self.special_normalized.patterns_len() > 0 {
            let mut normalized = NormalizedString::from(text);
            let ok = inner
                .get_normalizer()
                .is_none_or(|n| n.normalize(&mut normalized).is_ok());
            if !ok {
                // Unknown alignment: treat all of it as able to spell a token.
                let everything = 0..text.len();
                return vec![everything];
            }
            for m in self
                .special_normalized
                .find_overlapping_iter(normalized.get())
            {
                spans.push(original_span(&normalized, m.range()).unwrap_or(0..text.len()));
            }
        }
        let trimmed = text.trim();
        let trim_start = text.len() - text.trim_start().len();
        for (edge, offset) in [(text, 0), (trimmed, trim_start)] {
            spans.extend(
                self.edge_fragments(edge)
                    .map(|r| r.start + offset..r.end + offset),
            );
        }
        spans.sort_by_key(|r| (r.start, r.end));
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(spans.len());
        for span in spans.into_iter().filter(|r| !r.is_empty()) {
            match merged.last_mut() {
                Some(last) if span.start <= last.end => last.end = last.end.max(span.end),
                _ => merged.push(span),
            }
        }
        merged
    }

    /// The longest start of `text` that ends some special token's text, and
    /// the longest end of `text` that starts one (pieces a token could be
    /// completed from outside). Pieces with whitespace at their outer edge
    /// are left out: a template trimming the text must still see it.
    fn edge_fragments(&self, text: &str) -> impl Iterator<Item = Range<usize>> {
        let mut head = 0;
        let mut tail = 0;
        for token in &self.special_raw_texts {
            for cut in (1..token.len()).filter(|&i| token.is_char_boundary(i)) {
                let (front, back) = token.split_at(cut);
                if back.len() > head && text.starts_with(back) {
                    head = back.len();
                }
                if front.len() > tail && text.ends_with(front) {
                    tail = front.len();
                }
            }
        }
        let starts_blank = |s: &str| s.chars().next().is_some_and(char::is_whitespace);
        let ends_blank = |s: &str| s.chars().next_back().is_some_and(char::is_whitespace);
        let head = (head > 0 && !starts_blank(&text[..head])).then_some(0..head);
        let tail_start = text.len() - tail;
        let tail = (tail > 0 && !ends_blank(&text[tail_start..])).then_some(tail_start..text.len());
        head.into_iter().chain(tail)
    }

    /// Token ids of `text`, as the crate's `encode_fast` computes them but with
    /// only the special matches that `keep` allows.
    pub(crate) fn encode(
        &self,
        inner: &Inner,
        text: &str,
        add_special_tokens: bool,
        keep: Keep<'_>,
    ) -> tokenizers::Result<Encoding> {
        let mut pieces = self.extract(inner, text, keep)?;
        if let Some(pre) = inner.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pieces)?;
        }
        pieces.tokenize(|piece| inner.get_model().tokenize(piece.get()))?;
        let encoding = pieces.into_encoding(None, 0, OffsetType::None)?;
        inner.post_process(encoding, None, add_special_tokens)
    }

    /// The crate's `extract_and_normalize`: split on raw tokens, normalize what
    /// is left, split that on normalized tokens.
    fn extract(
        &self,
        inner: &Inner,
        text: &str,
        keep: Keep<'_>,
    ) -> tokenizers::Result<PreTokenizedString> {
        let mut pieces = PreTokenizedString::from(text);
        pieces.split(|_, piece| self.split(piece, &self.raw, keep))?;
        pieces.split(|_, mut piece| {
            if let Some(n) = inner.get_normalizer() {
                // The crate ignores a normalizer's error here too.
                let _ = n.normalize(&mut piece);
            }
            self.split(piece, &self.normalized, keep)
        })?;
        Ok(pieces)
    }

    fn split(
        &self,
        piece: NormalizedString,
        set: &MatchSet,
        keep: Keep<'_>,
    ) -> tokenizers::Result<Vec<(NormalizedString, Option<Vec<Token>>)>> {
        self.find_matches(&piece, set, keep)
            .into_iter()
            .map(|(id, span)| {
                let slice = piece
                    .slice(TextRange::Normalized(span))
                    .ok_or("added-token split is not on a character boundary")?;
                let tokens = id.map(|id| {
                    let value = slice.get().to_owned();
                    let len = value.len();
                    vec![Token::new(id, value, (0, len))]
                });
                Ok((slice, tokens))
            })
            .collect()
    }

    /// Splits covering all of `piece`, each with the id of the added token it
    /// is, if any.
    fn find_matches(
        &self,
        piece: &NormalizedString,
        set: &MatchSet,
        keep: Keep<'_>,
    ) -> Vec<(Option<u32>, Range<usize>)> {
        let sentence = piece.get();
        if sentence.is_empty() {
            return vec![(None, 0..0)];
        }
        let mut start_offset = 0;
        let mut splits = Vec::new();
        for mat in set.automaton.find_iter(sentence) {
            let (mut start, mut stop) = (mat.start(), mat.end());
            let id = set.ids[mat.pattern().as_usize()];
            let Some(rule) = self.rules.get(&id) else {
                continue;
            };
            if rule.special && !keep.allows(original_span(piece, start..stop)) {
                continue;
            }
            if rule.single_word {
                let start_space = start == 0 || !ends_with_word(&sentence[..start]);
                let stop_space = stop == sentence.len() || !starts_with_word(&sentence[stop..]);
                if !stop_space || !start_space {
                    continue;
                }
            }
            if rule.lstrip {
                start = space_leftmost_at_end(&sentence[..start]).max(start_offset);
            }
            if rule.rstrip {
                stop += space_rightmost_at_start(&sentence[stop..]);
            }
            if start_offset < start {
                splits.push((None, start_offset..start));
            }
            splits.push((Some(id), start..stop));
            start_offset = stop;
        }
        if start_offset != sentence.len() {
            splits.push((None, start_offset..sentence.len()));
        }
        splits
    }
}

/// Where bytes `span` of a piece's normalized text came from in the whole
/// input; None when the piece cannot say (then the match is not trusted).
fn original_span(piece: &NormalizedString, span: Range<usize>) -> Option<Range<usize>> {
    let local = piece.convert_offsets(TextRange::Normalized(span))?;
    let shift = piece.offsets_original().0;
    Some(local.start + shift..local.end + shift)
}

static STARTS_WITH_WORD: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^\w").unwrap());
static ENDS_WITH_WORD: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\w$").unwrap());
static RIGHTMOST_SPACE_AT_START: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^\s*").unwrap());
static LEFTMOST_SPACE_AT_END: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\s*$").unwrap());

fn ends_with_word(s: &str) -> bool {
    ENDS_WITH_WORD.is_match(s)
}

fn starts_with_word(s: &str) -> bool {
    STARTS_WITH_WORD.is_match(s)
}

fn space_leftmost_at_end(s: &str) -> usize {
    LEFTMOST_SPACE_AT_END.find(s).map_or(s.len(), |m| m.start())
}

fn space_rightmost_at_start(s: &str) -> usize {
    RIGHTMOST_SPACE_AT_START.find(s).map_or(0, |m| m.end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_sharing_a_byte() {
        let ranges = [2..5, 8..9, 12..12, 12..14];
        for (span, want) in [
            (0..2, false),
            (0..3, true),
            (4..6, true),
            (5..8, false),
            (8..8, false),
            (7..20, true),
            (9..12, false),
            (11..12, false),
            (11..13, true),
            (14..20, false),
        ] {
            assert_eq!(overlaps(&ranges, &span), want, "{span:?}");
        }
        assert!(!overlaps(&[], &(0..10)));
    }
}
