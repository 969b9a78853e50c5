//! Rendering a conversation so that special-token text inside its messages
//! stays text.
//!
//! A template may copy, trim, split or join message text, so where a message
//! lands in the rendered prompt cannot be read off the template. What must
//! not happen is narrower: a special token matched on bytes that came from a
//! message. So before rendering, every piece of a message that could take part
//! in such a match (`AddedTokens::special_spans`: the special tokens' texts,
//! and fragments at the edges that the template's own text could complete) is
//! swapped for a placeholder built from private-use characters that occur in
//! none of the inputs; after rendering, each placeholder is put back and its
//! bytes are marked protected, and the tokenizer skips special matches that
//! overlap a protected range. The template sees text equal to the original
//! except inside those pieces, and ordinary messages have no such pieces, so
//! their prompts render and tokenize exactly as before.

use super::chat::{ChatMessage, ChatTemplate};
use crate::{Error, Result};
use std::ops::Range;

/// A rendered prompt and the byte ranges of it that came from message text
/// and could otherwise be read as special tokens (sorted, disjoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtectedText {
    pub text: String,
    pub protected: Vec<Range<usize>>,
}

/// Placeholders are `MARK digit+ MARK`, the digits base 16, each a character
/// of the chosen block.
const DIGITS: usize = 16;
/// The top of Supplementary Private Use Area-B, searched downwards for a
/// block of characters that no input holds.
const PRIVATE_USE_TOP: u32 = 0x10_FFFD;
const PRIVATE_USE_BOTTOM: u32 = 0x10_0000;

/// Stand-ins for the risky pieces of message text, and what they stand for.
struct Placeholders {
    /// `block[0]` is the mark, `block[1..]` the digits 0-15.
    block: [char; DIGITS + 1],
    originals: Vec<String>,
}

impl Placeholders {
    /// A block of characters absent from every input the render sees.
    fn choose<'a>(inputs: impl Iterator<Item = &'a str>) -> Result<Self> {
        let mut used = std::collections::HashSet::new();
        for input in inputs {
            used.extend(
                input
                    .chars()
                    .filter(|&c| (PRIVATE_USE_BOTTOM..=PRIVATE_USE_TOP).contains(&(c as u32))),
            );
        }
        let size = (DIGITS + 1) as u32;
        let mut top = PRIVATE_USE_TOP;
        while top >= PRIVATE_USE_BOTTOM + size {
            let block: Vec<char> = (0..size).filter_map(|i| char::from_u32(top - i)).collect();
            if block.iter().all(|c| !used.contains(c)) {
                return Ok(Placeholders {
                    block: block.try_into().map_err(|_| {
                        Error::internal("private-use block has the wrong size".to_string())
                    })?,
                    originals: Vec::new(),
                });
            }
            top -= size;
        }
        Err(Error::invalid_arg(
            "the conversation uses every private-use character this library could mark message \
             text with"
                .to_string(),
        ))
    }

    fn mark(&self) -> char {
        self.block[0]
    }

    fn digit_value(&self, c: char) -> Option<usize> {
        self.block[1..].iter().position(|&d| d == c)
    }

    /// `text` with each of `spans` replaced by a new placeholder.
    fn defang(&mut self, text: &str, spans: &[Range<usize>]) -> String {
        if spans.is_empty() {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len() + spans.len() * 16);
        let mut at = 0;
        for span in spans {
            out.push_str(&text[at..span.start]);
            self.push_placeholder(&mut out, self.originals.len());
            self.originals.push(text[span.clone()].to_string());
            at = span.end;
        }
        out.push_str(&text[at..]);
        out
    }

    fn push_placeholder(&self, out: &mut String, index: usize) {
        out.push(self.mark());
        let digits = format!("{index:x}");
        for d in digits.bytes() {
            let value = (d as char).to_digit(16).unwrap_or(0) as usize;
            out.push(self.block[1 + value]);
        }
        out.push(self.mark());
    }

    /// Puts the originals back into `rendered`, marking where they went.
    /// Fails when the template cut a placeholder apart: the pieces of message
    /// text it stood for could then not be kept as text.
    fn restore(&self, rendered: &str) -> Result<ProtectedText> {
        let mut text = String::with_capacity(rendered.len());
        let mut protected = Vec::new();
        let mut rest = rendered;
        let cut = || {
            Error::invalid_arg(
                "the chat template cut apart message text that spells special tokens, so it \
                 cannot be rendered with that text kept as plain text"
                    .to_string(),
            )
        };
        while let Some(pos) = rest.find(|c| self.block.contains(&c)) {
            text.push_str(&rest[..pos]);
            let mut chars = rest[pos..].char_indices();
            let first = chars.next().map(|(_, c)| c);
            if first != Some(self.mark()) {
                return Err(cut());
            }
            let mut index = 0usize;
            let mut n_digits = 0;
            let end = loop {
                match chars.next() {
                    Some((i, c)) if c == self.mark() => break pos + i + c.len_utf8(),
                    Some((_, c)) => {
                        let value = self.digit_value(c).ok_or_else(cut)?;
                        index = index
                            .checked_mul(DIGITS)
                            .and_then(|x| x.checked_add(value))
                            .ok_or_else(cut)?;
                        n_digits += 1;
                    }
                    None => return Err(cut()),
                }
            };
            let original = self.originals.get(index).filter(|_| n_digits > 0);
            let original = original.ok_or_else(cut)?;
            protected.push(text.len()..text.len() + original.len());
            text.push_str(original);
            rest = &rest[end..];
        }
        text.push_str(rest);
        Ok(ProtectedText { text, protected })
    }
}

/// Renders `messages` with `template`, the risky pieces of each role and
/// content (found by `spans`) kept as text.
pub(crate) fn render(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    spans: impl Fn(&str) -> Vec<Range<usize>>,
) -> Result<ProtectedText> {
    // Per message: the spans of its role, then of its content.
    type Spans = Vec<Range<usize>>;
    let found: Vec<(Spans, Spans)> = messages
        .iter()
        .map(|m| (spans(&m.role), spans(&m.content)))
        .collect();
    if found.iter().all(|(r, c)| r.is_empty() && c.is_empty()) {
        let text = template.render(messages, add_generation_prompt)?;
        return Ok(ProtectedText {
            text,
            protected: Vec::new(),
        });
    }
    let inputs = messages
        .iter()
        .flat_map(|m| [m.role.as_str(), m.content.as_str()])
        .chain(template.inputs());
    let mut placeholders = Placeholders::choose(inputs)?;
    let defanged: Vec<ChatMessage> = messages
        .iter()
        .zip(&found)
        .map(|(m, (role_spans, content_spans))| ChatMessage {
            role: placeholders.defang(&m.role, role_spans),
            content: placeholders.defang(&m.content, content_spans),
        })
        .collect();
    let rendered = template.render(&defanged, add_generation_prompt)?;
    placeholders.restore(&rendered)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_round_trip() {
        let mut p = Placeholders::choose(["abc", "\u{10FFFD}x"].into_iter()).unwrap();
        assert!(p.block.iter().all(|&c| c != '\u{10FFFD}'));
        let text = "a<x>b<y>c";
        let defanged = p.defang(text, &[1..4, 5..8]);
        assert!(!defanged.contains('<'), "{defanged:?}");
        let doubled = format!("[{defanged}|{defanged}]");
        let restored = p.restore(&doubled).unwrap();
        assert_eq!(restored.text, format!("[{text}|{text}]"));
        assert_eq!(restored.protected, vec![2..5, 6..9, 12..15, 16..19]);
        for r in &restored.protected {
            assert!(restored.text[r.clone()].starts_with('<'));
        }
    }

    #[test]
    fn many_placeholders_get_distinct_indices() {
        let mut p = Placeholders::choose(std::iter::empty()).unwrap();
        let text = "<s>".repeat(300);
        let spans: Vec<_> = (0..300).map(|i| i * 3..i * 3 + 3).collect();
        let defanged = p.defang(&text, &spans);
        let restored = p.restore(&defanged).unwrap();
        assert_eq!(restored.text, text);
        assert_eq!(restored.protected, spans);
    }

    #[test]
    fn cut_placeholders_are_refused() {
        let mut p = Placeholders::choose(std::iter::empty()).unwrap();
        let special = 1..4;
        let defanged = p.defang("x<s>", std::slice::from_ref(&special));
        let mark_len = p.mark().len_utf8();
        for broken in [
            &defanged[..defanged.len() - mark_len],
            &defanged[..1 + mark_len],
            &defanged[1 + mark_len..],
        ] {
            assert!(p.restore(broken).is_err(), "{broken:?}");
        }
        // A placeholder whose index was never handed out.
        let mut other = String::new();
        p.push_placeholder(&mut other, 7);
        assert!(p.restore(&other).is_err());
        let mut empty = String::new();
        empty.push(p.mark());
        empty.push(p.mark());
        assert!(p.restore(&empty).is_err());
    }
}
