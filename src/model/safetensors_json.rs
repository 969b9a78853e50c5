//! A JSON tree that keeps object entries in document order, duplicates
//! included. `serde_json::Value` (and derived structs over maps) silently
//! keep the last of two equal keys; a strict weight loader must see both.
//! serde_json still does the lexing, with its recursion limit.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Number;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Json>),
    /// Entries in document order; keys may repeat.
    Object(Vec<(String, Json)>),
}

/// Why a document could not be turned into a [`Json`] tree.
#[derive(Debug)]
pub(crate) enum JsonError {
    /// The bytes are not UTF-8.
    NotUtf8(std::str::Utf8Error),
    /// The text is not a JSON document (syntax error, early end, nesting too deep).
    Syntax(serde_json::Error),
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::NotUtf8(e) => write!(f, "not valid UTF-8 ({e})"),
            JsonError::Syntax(e) => write!(f, "not valid JSON ({e})"),
        }
    }
}

impl Json {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Json, JsonError> {
        let text = std::str::from_utf8(bytes).map_err(JsonError::NotUtf8)?;
        serde_json::from_str(text).map_err(JsonError::Syntax)
    }

    /// The JSON type name, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Number(_) => "a number",
            Json::String(_) => "a string",
            Json::Array(_) => "an array",
            Json::Object(_) => "an object",
        }
    }

    /// The value as a `usize` if it is a non-negative integer that fits.
    pub(crate) fn as_usize(&self) -> Option<usize> {
        match self {
            Json::Number(n) => n.as_u64().and_then(|v| usize::try_from(v).ok()),
            _ => None,
        }
    }
}

/// The first key that occurs twice among `entries`, if any.
pub(crate) fn first_duplicate_key(entries: &[(String, Json)]) -> Option<&str> {
    let mut seen = std::collections::HashSet::with_capacity(entries.len());
    entries
        .iter()
        .map(|(k, _)| k.as_str())
        .find(|k| !seen.insert(*k))
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Number::from_f64(v)
            .map(Json::Number)
            .ok_or_else(|| E::custom("non-finite number"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            entries.push((key, value));
        }
        Ok(Json::Object(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_duplicate_keys_in_order() {
        let j = Json::parse(br#"{"a": 1, "b": [true, null, "x"], "a": {"c": -2.5}}"#).unwrap();
        let Json::Object(entries) = &j else {
            panic!("not an object")
        };
        let keys: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", "b", "a"]);
        assert_eq!(first_duplicate_key(entries), Some("a"));
        assert_eq!(
            entries[1].1,
            Json::Array(vec![Json::Bool(true), Json::Null, Json::String("x".into())])
        );
    }

    #[test]
    fn usize_only_for_non_negative_integers() {
        let j = Json::parse(b"[0, 18446744073709551615, -1, 1.5, 1e30, \"3\"]").unwrap();
        let Json::Array(items) = j else {
            panic!("not an array")
        };
        let got: Vec<Option<usize>> = items.iter().map(Json::as_usize).collect();
        assert_eq!(got[0], Some(0));
        assert_eq!(got[1], usize::try_from(u64::MAX).ok());
        assert_eq!(&got[2..], &[None, None, None, None]);
    }

    #[test]
    fn rejects_bad_utf8_bad_syntax_and_deep_nesting() {
        assert!(matches!(
            Json::parse(b"{\"a\xff\": 1}"),
            Err(JsonError::NotUtf8(_))
        ));
        assert!(matches!(
            Json::parse(b"{\"a\": }"),
            Err(JsonError::Syntax(_))
        ));
        assert!(matches!(Json::parse(b"{} x"), Err(JsonError::Syntax(_))));
        let deep = "[".repeat(100_000);
        assert!(matches!(
            Json::parse(deep.as_bytes()),
            Err(JsonError::Syntax(_))
        ));
    }
}
