//! Chat templates, rendered the way transformers renders them.
//!
//! transformers' `_compile_jinja_template` uses a Jinja2 `ImmutableSandboxedEnvironment`
//! with `trim_blocks`, `lstrip_blocks`, loop controls, a `{% generation %}` tag, the
//! globals `raise_exception` and `strftime_now`, and a `tojson` filter that calls
//! Python's `json.dumps`. Templates are then rendered with `messages`, `tools`,
//! `documents`, `add_generation_prompt` and the tokenizer's special tokens. This module
//! configures minijinja to behave the same, including Python's way of printing values.

use super::pyfmt::{self, JsonOptions};
use super::sandbox::{self, RenderScope};
use super::SpecialTokens;
use crate::{Error, Result};
use minijinja::machinery::{
    make_string_output, CompiledTemplate, Instructions, TemplateConfig, Vm, WhitespaceConfig,
};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template plus the special tokens it is rendered with. It is compiled
/// when created (syntax errors surface then) and again, with the sandbox's
/// checks woven in, for each render (see `sandbox`).
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template text after the `{% generation %}` rewrite and `sandbox::prepare`.
    source: String,
    /// Where the template came from, for error messages (e.g. "tokenizer_config.json").
    origin: String,
    special: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from in error messages.
    pub fn new(source: &str, origin: &str, special: SpecialTokens) -> Result<Self> {
        if source.len() > sandbox::MAX_SOURCE_BYTES {
            return Err(Error::invalid_model(format!(
                "chat template from {origin} is {} bytes, over the limit of {} bytes",
                source.len(),
                sandbox::MAX_SOURCE_BYTES
            )));
        }
        let mut env = Environment::new();
        sandbox::install(&mut env);
        env.set_formatter(|out, _state, value| {
            sandbox::reserve_print(value)?;
            let text = pyfmt::python_str(value);
            sandbox::charge_text(&text, "output")?;
            out.write_str(&text).map_err(minijinja::Error::from)
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let source =
            sandbox::prepare(&rewrite_generation_tags(source), WS_CONFIG).map_err(|e| {
                Error::invalid_model(format!("chat template from {origin} is too complex: {e}"))
            })?;
        let template = ChatTemplate {
            env,
            source,
            origin: origin.to_string(),
            special,
        };
        compile(&template.source).map_err(|e| {
            Error::invalid_model(format!(
                "chat template from {origin} does not compile: {}",
                describe(&e, sandbox::FUEL)
            ))
        })?;
        Ok(template)
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the
    /// assistant's turn header so the model continues as the assistant.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let input_bytes: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        let fuel = sandbox::fuel_for(messages.len());
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_iter([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ];
        for (name, token) in self.special.named() {
            ctx.push((name, Value::from(token)));
        }
        if !self.special.additional.is_empty() {
            ctx.push((
                "additional_special_tokens",
                Value::from(self.special.additional.clone()),
            ));
        }
        let ctx = Value::from_iter(ctx);
        let _budget = RenderScope::enter(input_bytes);
        let mut out = String::new();
        // minijinja 2.24 (and 3.0) panics on reverse slices of empty sequences, e.g.
        // `messages[::-1]` with no messages; the environment is only read here, so
        // nothing is left inconsistent by unwinding out of it.
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let compiled = compile(&self.source)?;
            let instructions = sandbox::harden(&compiled.instructions);
            let blocks: BTreeMap<&str, Instructions<'_>> = compiled
                .blocks
                .iter()
                .map(|(name, block)| (*name, sandbox::harden(block)))
                .collect();
            // The allowance scales with the conversation; the environment
            // holds it, so each render runs on its own copy (a few maps of
            // shared function handles).
            let mut env = self.env.clone();
            env.set_fuel(Some(fuel));
            Vm::new(&env)
                .eval(
                    &instructions,
                    ctx,
                    &blocks,
                    &mut make_string_output(&mut out),
                    AutoEscape::None,
                )
                .map(drop)
        }))
        .map_err(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Error::invalid_arg(format!(
                "chat template from {} failed to render: template engine error: {what}",
                self.origin
            ))
        })?;
        rendered.map_err(|e| {
            Error::invalid_arg(format!(
                "chat template from {} failed to render: {}",
                self.origin,
                describe(&e, fuel)
            ))
        })?;
        Ok(out)
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The text a render sees besides the messages: the template and the
    /// special tokens' texts.
    pub(crate) fn inputs(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.source.as_str())
            .chain(self.special.named().map(|(_, token)| token))
            .chain(self.special.additional.iter().map(String::as_str))
    }
}

/// transformers' whitespace settings.
const WS_CONFIG: WhitespaceConfig = WhitespaceConfig {
    keep_trailing_newline: false,
    lstrip_blocks: true,
    trim_blocks: true,
};

/// Compiles with transformers' settings (see `WS_CONFIG`), without auto-escaping.
fn compile(source: &str) -> std::result::Result<CompiledTemplate<'_>, minijinja::Error> {
    let config = TemplateConfig {
        syntax_config: Default::default(),
        ws_config: WS_CONFIG,
        default_auto_escape: Arc::new(|_: &str| AutoEscape::None),
    };
    CompiledTemplate::new(TEMPLATE_NAME, source, &config)
}

/// The error and its causes on one line, with the limit named when one was
/// hit (`fuel`: the instruction allowance it ran under).
fn describe(err: &minijinja::Error, fuel: u64) -> String {
    let mut msg = match err.kind() {
        ErrorKind::OutOfFuel => format!("step limit of {fuel} instructions exceeded: {err}"),
        _ if err.to_string().contains("recursion limit") => format!(
            "recursion limit of {} exceeded: {err}",
            sandbox::MAX_RECURSION
        ),
        _ => err.to_string(),
    };
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        msg.push_str(": ");
        msg.push_str(&cause.to_string());
        source = cause.source();
    }
    msg
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for
/// training masks and otherwise renders its body; `{% if true %}` behaves the same,
/// including under trim_blocks/lstrip_blocks and `-` whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        let (before, tag) = rest.split_at(pos);
        out.push_str(before);
        let after_open = &tag[2..];
        let marker_len = after_open.starts_with(['-', '+']) as usize;
        let body = &after_open[marker_len..];
        let trimmed = body.trim_start();
        let ws = &body[..body.len() - trimmed.len()];
        let replaced = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(kw, _)| {
                trimmed.starts_with(kw)
                    && !trimmed[kw.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            });
        out.push_str("{%");
        out.push_str(&after_open[..marker_len]);
        out.push_str(ws);
        rest = match replaced {
            Some((kw, with)) => {
                out.push_str(with);
                &trimmed[kw.len()..]
            }
            None => trimmed,
        };
    }
    out.push_str(rest);
    out
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, unlike Jinja2's HTML-escaping builtin.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson: indent must be an integer or string, not {}",
                        v.kind()
                    ),
                ))
            }
        },
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => Some((
                    item.as_str().unwrap_or_default().to_string(),
                    key.as_str().unwrap_or_default().to_string(),
                )),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    };
    kwargs.assert_all_used()?;
    let opts = JsonOptions::new(
        ensure_ascii.unwrap_or(false),
        indent,
        separators,
        sort_keys.unwrap_or(false),
    );
    // Separators and indentation are added per item, the indentation once per level.
    let per_item = opts.item_separator.len()
        + opts.key_separator.len()
        + opts
            .indent
            .as_ref()
            .map_or(0, |i| i.len() * sandbox::MAX_DEPTH + 1);
    sandbox::reserve_json(value, per_item)?;
    let json = pyfmt::json_dumps(value, &opts)?;
    sandbox::charge_text(&json, "tojson")?;
    Ok(json)
}

/// `datetime.now().strftime(format)`: local time through the C library, as CPython does.
#[cfg(unix)]
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use std::ffi::CString;
    let fail = |what: &str| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {what}"))
    };
    if format.is_empty() {
        return Ok(String::new());
    }
    let c_format = CString::new(format.as_str()).map_err(|_| fail("format contains a NUL byte"))?;
    // SAFETY: passing a null pointer asks time() only to return the current time.
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    // SAFETY: tm is plain old data; all-zero is a valid value that localtime_r overwrites.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the duration of the call; localtime_r is the
    // thread-safe variant and writes only into `tm`.
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return Err(fail("cannot read the local time"));
    }
    let mut capacity = 64 + format.len() * 16;
    while capacity <= 1 << 20 {
        let mut buf = vec![0u8; capacity];
        // SAFETY: buf is writable for buf.len() bytes, c_format is NUL-terminated and tm
        // was filled by localtime_r; strftime writes at most buf.len() bytes.
        let n =
            unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm) };
        // 0 means "did not fit" (the empty result was handled above).
        if n > 0 {
            buf.truncate(n);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        capacity *= 4;
    }
    Err(fail("formatted time is too long"))
}

#[cfg(not(unix))]
fn strftime_now(_format: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        "strftime_now is not supported on this platform",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage], gen: bool) -> Result<String> {
        ChatTemplate::new(source, "test", SpecialTokens::default())?.render(messages, gen)
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}{% generations %}"),
            "a{%- if true -%}b{% endif %}{% generations %}"
        );
        let msgs = [ChatMessage::new("assistant", "hi")];
        let out = render(
            "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
            &msgs,
            false,
        );
        assert_eq!(out.unwrap(), "hi");
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let err = render("{{ raise_exception('bad roles') }}", &[], false).unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::InvalidArgument);
        assert!(err.message.contains("bad roles"), "{}", err.message);
        assert!(err.message.contains("test"), "{}", err.message);
    }

    #[test]
    fn syntax_errors_fail_at_compile_time() {
        let err = ChatTemplate::new(
            "{% for m in messages %}",
            "x.jinja",
            SpecialTokens::default(),
        )
        .unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::InvalidModel);
        assert!(
            err.message.contains("x.jinja") && err.message.contains("does not compile"),
            "{}",
            err.message
        );
    }

    #[test]
    fn engine_panics_become_errors() {
        let err = render(
            "{% for m in messages[::-1] %}{{ m.role }}{% endfor %}",
            &[],
            true,
        )
        .unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::InvalidArgument);
        let msgs = [
            ChatMessage::new("user", "a"),
            ChatMessage::new("assistant", "b"),
        ];
        let out = render(
            "{% for m in messages[::-1] %}{{ m.role }} {% endfor %}",
            &msgs,
            true,
        );
        assert_eq!(out.unwrap(), "assistant user ");
    }

    #[test]
    fn strftime_now_formats_local_time() {
        let year = render("{{ strftime_now('%Y') }}", &[], false).unwrap();
        assert_eq!(year.len(), 4);
        assert!(year.parse::<u32>().unwrap() >= 2024, "{year}");
        let date = render("{{ strftime_now('%d %b %Y') }}", &[], false).unwrap();
        assert_eq!(date.len(), 11, "{date}");
        assert_eq!(render("{{ strftime_now('') }}", &[], false).unwrap(), "");
    }

    /// Each hostile template fails quickly with an error naming the origin and the limit.
    #[test]
    fn hostile_templates_hit_limits() {
        let msgs = [ChatMessage::new("user", "hi")];
        let cases = [
            ("{{ '%999999999999999s' | format('x') }}", "format width"),
            ("{{ '{:>999999999}'.format('x') }}", "format width"),
            ("{{ 'x' | indent(1000000000000) }}", "indent width"),
            ("{{ 'x' * 1000000000000000000 }}", "render budget"),
            ("{{ ([1] * 1000000000) | list | length }}", "100000 items"),
            ("{{ [1] | batch(1000000000000, 0) | list }}", "100000 items"),
            (
                "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}\
                 {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
                "render budget",
            ),
            (
                "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}\
                 {% set ns.s = ns.s + ns.s %}{% endfor %}",
                "render budget",
            ),
            (
                "{% set ns = namespace(s='ab') %}{% for i in range(64) %}\
                 {% set ns.s = ns.s.replace('a', ns.s) %}{% endfor %}",
                "render budget",
            ),
            (
                "{% set ns = namespace(s=['ab']) %}{% for i in range(64) %}\
                 {% set ns.s = [ns.s, ns.s] | join %}{% endfor %}",
                "render budget",
            ),
            (
                "{% set ns = namespace(x=1) %}{% for i in range(1000) %}\
                 {% set ns.x = [ns.x] %}{% endfor %}",
                "nested deeper",
            ),
            (
                "{% for a in range(100000) %}{% for b in range(100000) %}\
                 {% endfor %}{% endfor %}",
                "step limit",
            ),
            (
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                "recursion limit",
            ),
            (
                "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}\
                 {% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}",
                "render budget",
            ),
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}\
                 0123456789012345678901234567890123456789012345678901234567890123\
                 {% endfor %}{% endfor %}",
                "step limit",
            ),
            (
                "{% set big = 'x' * 10000 %}{% for i in range(100000) %}{{ big }}{% endfor %}",
                "render budget",
            ),
        ];
        for (source, limit) in cases {
            let started = std::time::Instant::now();
            let err = ChatTemplate::new(source, "hostile.jinja", SpecialTokens::default())
                .and_then(|t| t.render(&msgs, true))
                .unwrap_err();
            assert!(
                err.message.contains("hostile.jinja") && err.message.contains(limit),
                "{source}: {}",
                err.message
            );
            assert!(
                started.elapsed().as_secs() < 5,
                "{source} took {:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn oversized_and_deeply_nested_sources_do_not_compile() {
        let big = "x".repeat(sandbox::MAX_SOURCE_BYTES + 1);
        let err = ChatTemplate::new(&big, "big.jinja", SpecialTokens::default()).unwrap_err();
        assert!(err.message.contains("big.jinja") && err.message.contains("limit"));
        let deep = format!("{{{{ {}1{} }}}}", "(".repeat(100_000), ")".repeat(100_000));
        let chain = format!("{{{{ x{} }}}}", "~1".repeat(100_000));
        for source in [deep, chain] {
            let err = ChatTemplate::new(&source, "deep.jinja", SpecialTokens::default());
            assert!(err.unwrap_err().message.contains("deep.jinja"));
        }
        // Constant repetition is not folded at compile time, where no budget applies.
        let folded = format!("{{{{ 'x' * 99999999{} }}}}", " ~ 'x' * 99999999".repeat(50));
        let t = ChatTemplate::new(&folded, "fold.jinja", SpecialTokens::default()).unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.message.contains("render budget"), "{}", err.message);
    }

    #[test]
    fn tojson_rejects_bad_arguments() {
        assert!(render("{{ 1 | tojson(colour=1) }}", &[], false).is_err());
        assert!(render("{{ 1 | tojson(separators=[1]) }}", &[], false).is_err());
        assert_eq!(
            render("{{ [1] | tojson(indent='\t') }}", &[], false).unwrap(),
            "[\n\t1\n]"
        );
    }
}
