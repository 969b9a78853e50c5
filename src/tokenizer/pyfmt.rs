//! Python-compatible text forms of template values: `json.dumps` (what
//! transformers' `tojson` filter calls) and `str()`/`repr()` (what Jinja2 prints
//! for `{{ value }}`). Chat templates are written against Python's output, so the
//! spacing of `{"a": 1}`, `True`, `None` and `1e+20` must match it exactly.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write;

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Debug, Clone)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None` for single-line output; otherwise the string repeated per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl JsonOptions {
    /// Python's defaults: `", "` between items unless an indent is given (then `","`).
    pub fn new(
        ensure_ascii: bool,
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
    ) -> Self {
        let (item_separator, key_separator) = separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_string(), ": ".to_string())
        });
        JsonOptions {
            ensure_ascii,
            indent,
            item_separator,
            key_separator,
            sort_keys,
        }
    }
}

fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {} is not JSON serializable", value.kind()),
    )
}

/// `json.dumps(value, ...)`.
pub fn json_dumps(value: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, opts, 0)?;
    Ok(out)
}

fn write_newline_indent(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, opts, level, '[', ']', &items, |out, item, level| {
                write_json(out, item, opts, level)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                opts,
                level,
                '{',
                '}',
                &entries,
                |out, (key, item), level| {
                    write_json_string(out, key, opts.ensure_ascii);
                    out.push_str(&opts.key_separator);
                    write_json(out, item, opts, level)
                },
            )?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    opts: &JsonOptions,
    level: usize,
    open: char,
    close: char,
    items: &[T],
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&opts.item_separator);
        }
        write_newline_indent(out, opts, level + 1);
        write_item(out, item, level + 1)?;
    }
    write_newline_indent(out, opts, level);
    out.push(close);
    Ok(())
}

/// Python converts non-string keys: `True` → "true", `None` → "null", numbers via repr.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Number => Ok(json_number(key)),
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        "NaN".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else {
        float_repr(f)
    }
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, positional for
/// exponents in [-4, 16), otherwise `d.ddde+XX`.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    let sci = format!("{:e}", f.abs()); // shortest digits, e.g. "1.5e-7", "2e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

/// What Jinja2 prints for `{{ value }}`: Python's `str(value)`.
pub fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Seq | ValueKind::Map | ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            python_repr(value)
        }
        _ => value.to_string(),
    }
}

/// Python's `repr(value)` for the types a template can build.
pub fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => "None".to_string(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_string(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN)),
        ValueKind::String => string_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq => match value.try_iter() {
            Ok(items) => {
                let parts: Vec<String> = items.map(|v| python_repr(&v)).collect();
                format!("[{}]", parts.join(", "))
            }
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let parts: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", python_repr(&k), python_repr(&v))
                    })
                    .collect();
                format!("{{{}}}", parts.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Characters Python's `str.isprintable()` rejects (controls, format characters,
/// separators other than the ASCII space) for the ranges templates meet in practice.
fn is_unprintable(c: char) -> bool {
    matches!(c as u32,
        0x00..=0x1f | 0x7f..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f
        | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000 | 0xfeff | 0xfff9..=0xfffb
        | 0xe000..=0xf8ff)
}

fn string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_unprintable(c) => {
                let n = c as u32;
                let _ = if n <= 0xff {
                    write!(out, "\\x{n:02x}")
                } else {
                    write!(out, "\\u{n:04x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-0.25, "-0.25"),
            (1e20, "1e+20"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789.125, "123456789.125"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "repr({f:e})");
        }
    }

    #[test]
    fn json_dumps_defaults_and_options() {
        let v = Value::from_iter([("b", Value::from(1)), ("a", Value::from(vec!["x", "é"]))]);
        let plain = JsonOptions::new(false, None, None, false);
        assert_eq!(
            json_dumps(&v, &plain).unwrap(),
            r#"{"b": 1, "a": ["x", "é"]}"#
        );
        let sorted_ascii = JsonOptions::new(true, None, None, true);
        assert_eq!(
            json_dumps(&v, &sorted_ascii).unwrap(),
            r#"{"a": ["x", "\u00e9"], "b": 1}"#
        );
        let indented = JsonOptions::new(false, Some("  ".into()), None, false);
        assert_eq!(
            json_dumps(&v, &indented).unwrap(),
            "{\n  \"b\": 1,\n  \"a\": [\n    \"x\",\n    \"é\"\n  ]\n}"
        );
        assert_eq!(
            json_dumps(&Value::from("\u{1}<&>"), &plain).unwrap(),
            "\"\\u0001<&>\""
        );
        assert!(json_dumps(&Value::UNDEFINED, &plain).is_err());
    }

    #[test]
    fn repr_matches_python() {
        assert_eq!(python_repr(&Value::from("it's")), "\"it's\"");
        assert_eq!(
            python_repr(&Value::from("say \"hi\" it's")),
            "'say \"hi\" it\\'s'"
        );
        assert_eq!(
            python_repr(&Value::from("a\u{200b}\u{a0}\n")),
            "'a\\u200b\\xa0\\n'"
        );
        assert_eq!(python_str(&Value::from(())), "None");
        assert_eq!(python_str(&Value::from(true)), "True");
        assert_eq!(
            python_str(&Value::from(vec![Value::from(1), Value::from(())])),
            "[1, None]"
        );
    }
}
