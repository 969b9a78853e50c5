//! The bytes each token id stands for, as a grammar engine's token trie
//! needs them (llguidance builds its masks from these). Written here rather
//! than taken from `toktrie_hf_tokenizers`: that crate pins another major
//! version of `tokenizers` (two copies would be linked into the library),
//! and its converters panic on some malformed vocabularies, while a model
//! directory is untrusted input.

use super::Tokenizer;
use crate::{bail_model, Result};

/// What one token id is, for a grammar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// Ordinary text: these bytes.
    Text(Vec<u8>),
    /// An added special token (`<|im_end|>`...): not text a grammar matches.
    Special(String),
    /// No token has this id.
    Missing,
}

/// How vocabulary strings encode bytes, read from the tokenizer's decoder.
enum Encoding {
    /// GPT-2 byte-level BPE: each byte is one printable char.
    ByteLevel,
    /// SentencePiece style: `<0xAB>` byte tokens, `space` standing for ' '.
    ByteFallback { space: char },
}

impl Tokenizer {
    /// One entry per id below [`vocab_size`](Tokenizer::vocab_size).
    pub fn token_bytes(&self) -> Result<Vec<TokenBytes>> {
        let encoding = self.byte_encoding()?;
        let byte_of_char = byte_level_table();
        let added: std::collections::HashSet<u32> =
            self.hf().get_added_tokens_decoder().into_keys().collect();
        let mut out = Vec::with_capacity(self.vocab_size());
        for id in 0..self.vocab_size() as u32 {
            let Some(name) = self.id_to_token(id) else {
                out.push(TokenBytes::Missing);
                continue;
            };
            // Added tokens shaped `<...>` count as special even when not
            // marked so (as llguidance's own converter treats them): a
            // grammar must not spell them out as text.
            let special_looking = added.contains(&id) && is_angle_bracketed(&name);
            if self.is_special_id(id) || special_looking {
                out.push(TokenBytes::Special(name));
                continue;
            }
            let bytes = match encoding {
                Encoding::ByteLevel => name
                    .chars()
                    .map(&byte_of_char)
                    .collect::<Option<Vec<u8>>>()
                    // An added non-special token is stored as plain text.
                    .unwrap_or_else(|| name.clone().into_bytes()),
                Encoding::ByteFallback { space } => match hex_byte(&name) {
                    Some(b) => vec![b],
                    None => name.replace(space, " ").into_bytes(),
                },
            };
            out.push(TokenBytes::Text(bytes));
        }
        Ok(out)
    }

    fn byte_encoding(&self) -> Result<Encoding> {
        let decoder = serde_json::to_value(self.hf().get_decoder()).unwrap_or_default();
        let mut kinds = Vec::new();
        let mut space = ' ';
        collect_decoders(&decoder, &mut kinds, &mut space);
        if kinds.iter().any(|k| k == "ByteLevel") {
            Ok(Encoding::ByteLevel)
        } else if kinds.iter().any(|k| k == "ByteFallback") {
            Ok(Encoding::ByteFallback { space })
        } else {
            bail_model!(
                "tokenizer.json: structured output needs a byte-level or byte-fallback decoder, \
                 found {:?}",
                kinds
            )
        }
    }
}

/// The decoder types of a (possibly nested) decoder config, and the char a
/// `Replace` decoder turns into a space.
fn collect_decoders(d: &serde_json::Value, kinds: &mut Vec<String>, space: &mut char) {
    let Some(kind) = d.get("type").and_then(|t| t.as_str()) else {
        return;
    };
    kinds.push(kind.to_string());
    if kind == "Replace" && d.get("content").and_then(|c| c.as_str()) == Some(" ") {
        let pattern = d["pattern"]["String"].as_str().unwrap_or("");
        let mut chars = pattern.chars();
        if let (Some(c), None) = (chars.next(), chars.next()) {
            *space = c;
        }
    }
    for sub in d
        .get("decoders")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
    {
        collect_decoders(sub, kinds, space);
    }
}

fn is_angle_bracketed(name: &str) -> bool {
    name.len() > 2 && name.starts_with('<') && name.ends_with('>')
}

/// `<0xAB>` as its byte.
fn hex_byte(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// GPT-2's byte-level alphabet inverted: printable bytes stand for
/// themselves, the others for the chars from U+0100 on, in byte order.
fn byte_level_table() -> impl Fn(char) -> Option<u8> {
    let mut table = std::collections::HashMap::with_capacity(256);
    let mut next = 256u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        table.insert(char::from_u32(c).expect("valid char"), b as u8);
    }
    move |c| table.get(&c).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        let f = byte_level_table();
        assert_eq!(f('A'), Some(b'A'));
        assert_eq!(f('Ġ'), Some(b' ')); // U+0120
        assert_eq!(f('Ċ'), Some(b'\n')); // U+010A
        assert_eq!(f('ÿ'), Some(0xff));
        assert_eq!(f('好'), None);
    }

    #[test]
    fn hex_bytes() {
        assert_eq!(hex_byte("<0x0A>"), Some(10));
        assert_eq!(hex_byte("<0xZZ>"), None);
        assert_eq!(hex_byte("<0x0>"), None);
        assert_eq!(hex_byte("hello"), None);
    }
}
