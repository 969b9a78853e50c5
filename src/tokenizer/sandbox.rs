//! Limits for rendering untrusted chat templates.
//!
//! A template comes with the model directory, so it is hostile input that runs
//! inside the host process. minijinja's fuel bounds how many instructions run and
//! its recursion limit how deep macros nest, but neither bounds the *size* of
//! what one instruction builds: `s ~ s` doubles a string per step, `replace`
//! squares it, and a format width of 10^18 asks for that many bytes at once. So
//! the compiled program is rewritten before it runs ([`harden`]):
//!
//! - `~`, `+` and `*` first call a check that prices the result against a
//!   per-render byte budget (and caps repeated sequences at [`MAX_ITEMS`]);
//! - literal text is emitted through the formatter, so every output byte (and
//!   every byte captured by `{% set %}` blocks and macro calls) is charged too;
//! - values stored in variables or namespaces may nest at most [`MAX_DEPTH`]
//!   levels (dropping or printing a deeper one would overflow the stack);
//! - loop iterations and calls check a wall-clock deadline, a backstop for
//!   instructions whose cost grows with the size of their operands.
//!
//! The filters and methods that can amplify their input (`format`, `indent`,
//! `join`, `replace`, `string`, `pprint`, `batch`, `slice`, pycompat's `format`,
//! `join`, `replace`) are replaced by versions that check widths and price the
//! result before delegating to minijinja.

use minijinja::machinery::{tokenize, Instruction, Instructions, Token, WhitespaceConfig};
use minijinja::value::{Kwargs, Rest, StringInput, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Largest template source compiled. Real templates are a few KiB to a few tens of KiB.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;
/// Tokens in one `{{ }}` or `{% %}` tag. minijinja folds constant expressions and
/// compiles operator chains recursively, so a chain of 100 000 `~` overflows the
/// stack at compile time; real tags have tens of tokens.
pub const MAX_TAG_TOKENS: usize = 1000;
/// Instructions one render may execute before counting its messages (the
/// hardening adds about three per loop iteration, call and operator). With
/// [`FUEL_PER_MESSAGE`] and [`MAX_FUEL`], see [`fuel_for`].
pub const FUEL: u64 = 2_000_000;
/// Instructions added to a render's allowance per message. Real templates
/// spend tens per message (35–55 for the ChatML, alternating-roles and
/// generation-tag test templates), so a conversation of any length fits,
/// while a template that loops over the messages in a nested loop runs out.
pub const FUEL_PER_MESSAGE: u64 = 1_000;
/// The most instructions any render may execute: a few seconds, within
/// [`DEADLINE`]. Reached at about 62 000 messages, more than any context
/// holds.
pub const MAX_FUEL: u64 = 64_000_000;

/// The instruction allowance of a render of `messages` messages.
pub fn fuel_for(messages: usize) -> u64 {
    let per_message = FUEL_PER_MESSAGE.saturating_mul(messages as u64);
    FUEL.saturating_add(per_message).min(MAX_FUEL)
}
/// Nesting of macro calls, recursive loops and includes.
pub const MAX_RECURSION: usize = 64;
/// Bytes one render may build (output, concatenations, formatted values), on top of
/// [`BUDGET_PER_INPUT_BYTE`] per byte of the conversation it renders.
pub const BASE_BUDGET: usize = 64 << 20;
pub const BUDGET_PER_INPUT_BYTE: usize = 8;
/// Largest width or precision in a format spec, and the largest `indent` width.
pub const MAX_WIDTH: usize = 4096;
/// Longest sequence a repetition or concatenation may build (the cap `range` has).
pub const MAX_ITEMS: usize = 100_000;
/// Deepest nesting of lists and maps a variable may hold.
pub const MAX_DEPTH: usize = 64;
/// Wall-clock bound of one render.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// The budget of the render running on this thread.
#[derive(Clone, Copy)]
struct Budget {
    remaining: usize,
    total: usize,
    deadline: Instant,
}

thread_local! {
    static ACTIVE: Cell<Option<Budget>> = const { Cell::new(None) };
}

/// Installs a render's budget on this thread; dropping it restores the previous one.
pub struct RenderScope {
    previous: Option<Budget>,
}

impl RenderScope {
    pub fn enter(input_bytes: usize) -> Self {
        let total = BASE_BUDGET.saturating_add(input_bytes.saturating_mul(BUDGET_PER_INPUT_BYTE));
        let budget = Budget {
            remaining: total,
            total,
            deadline: Instant::now() + DEADLINE,
        };
        RenderScope {
            previous: ACTIVE.with(|a| a.replace(Some(budget))),
        }
    }
}

impl Drop for RenderScope {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.previous));
    }
}

fn limit_error(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Bytes left in the render budget (unbounded outside a render).
fn remaining() -> usize {
    ACTIVE.with(|a| a.get().map_or(usize::MAX, |b| b.remaining))
}

/// Fails, naming what wanted them, when `bytes` would not fit in the render budget.
fn reserve(bytes: usize, what: &str) -> Result<(), Error> {
    ACTIVE.with(|a| match a.get() {
        Some(b) if bytes > b.remaining => Err(limit_error(format!(
            "{what} would build {bytes} bytes, over the render budget of {} bytes",
            b.total
        ))),
        _ => Ok(()),
    })
}

/// Takes `bytes` from the render budget, or fails naming what wanted them.
fn charge(bytes: usize, what: &str) -> Result<(), Error> {
    reserve(bytes, what)?;
    ACTIVE.with(|a| {
        if let Some(mut b) = a.get() {
            b.remaining -= bytes;
            a.set(Some(b));
        }
    });
    Ok(())
}

fn check_deadline() -> Result<(), Error> {
    ACTIVE.with(|a| match a.get() {
        Some(b) if Instant::now() > b.deadline => Err(limit_error(format!(
            "rendering took longer than the time limit of {} s",
            DEADLINE.as_secs()
        ))),
        _ => Ok(()),
    })
}

/// An upper bound of the bytes `value` prints as (Python `str`/`repr`, Jinja
/// `~`, JSON), or `None` when it exceeds `limit` or nests deeper than
/// [`MAX_DEPTH`]. Strings count `per_byte` bytes per byte (escapes) and every
/// item of a container `per_item` bytes (separators, quotes, indentation).
fn printed_size(value: &Value, limit: usize, per_byte: usize, per_item: usize) -> Option<usize> {
    fn walk(
        v: &Value,
        depth: usize,
        total: &mut usize,
        limit: usize,
        pb: usize,
        pi: usize,
    ) -> bool {
        let add = |total: &mut usize, n: usize| {
            *total = total.saturating_add(n);
            *total <= limit
        };
        match v.kind() {
            ValueKind::String => add(total, v.as_str().map_or(0, str::len).saturating_mul(pb)),
            ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
                if depth >= MAX_DEPTH {
                    *total = usize::MAX;
                    return false;
                }
                let Ok(items) = v.try_iter() else {
                    return add(total, 64);
                };
                let is_map = v.kind() == ValueKind::Map;
                if !add(total, 2) {
                    return false;
                }
                for item in items {
                    if !add(total, pi) || !walk(&item, depth + 1, total, limit, pb, pi) {
                        return false;
                    }
                    if is_map {
                        let Ok(child) = v.get_item(&item) else {
                            continue;
                        };
                        if !add(total, pi) || !walk(&child, depth + 1, total, limit, pb, pi) {
                            return false;
                        }
                    }
                }
                true
            }
            // Numbers, booleans, none, undefined and opaque objects print short.
            _ => add(total, 64),
        }
    }
    let mut total = 0;
    walk(value, 0, &mut total, limit, per_byte, per_item).then_some(total)
}

/// The printed size of `value`, checked against the budget left.
fn priced(value: &Value, per_byte: usize, per_item: usize, what: &str) -> Result<usize, Error> {
    let left = remaining();
    printed_size(value, left, per_byte, per_item).ok_or_else(|| {
        limit_error(format!(
            "{what} would print more than the {left} bytes left of the render budget \
             (or a value nested deeper than {MAX_DEPTH} levels)"
        ))
    })
}

/// Checks that Python `str(value)` fits in the budget; call before building it.
pub fn reserve_print(value: &Value) -> Result<(), Error> {
    if value.as_str().is_none() {
        priced(value, 4, 4, "printing a value")?;
    }
    Ok(())
}

/// Checks that `json.dumps(value)` fits, `per_item` being the separators and
/// indentation one item may add.
pub fn reserve_json(value: &Value, per_item: usize) -> Result<(), Error> {
    priced(value, 6, per_item.saturating_add(2), "tojson").map(drop)
}

/// Takes text that was built (or is about to be written) from the budget.
pub fn charge_text(text: &str, what: &str) -> Result<(), Error> {
    charge(text.len(), what)
}

fn seq_len(value: &Value) -> Option<usize> {
    if !matches!(value.kind(), ValueKind::Seq | ValueKind::Iterable) {
        return None;
    }
    value.len().or_else(|| {
        value
            .try_iter()
            .ok()
            .map(|it| it.take(MAX_ITEMS + 1).count())
    })
}

fn check_items(n: Option<usize>, what: &str) -> Result<(), Error> {
    match n {
        Some(n) if n <= MAX_ITEMS => Ok(()),
        _ => Err(limit_error(format!(
            "{what} would build a sequence longer than {MAX_ITEMS} items"
        ))),
    }
}

/// The operands `[a, b]` back in the order `UnpackList(2)` restores them.
fn pass(a: &Value, b: &Value) -> Value {
    Value::from(vec![b.clone(), a.clone()])
}

fn check_concat(a: &Value, b: &Value) -> Result<Value, Error> {
    let bound = |v: &Value| match v.as_str() {
        Some(s) => Ok(s.len()),
        None => priced(v, 4, 4, "`~`"),
    };
    charge(bound(a)?.saturating_add(bound(b)?), "`~`")?;
    Ok(pass(a, b))
}

fn check_add(a: &Value, b: &Value) -> Result<Value, Error> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        charge(x.len().saturating_add(y.len()), "`+`")?;
    } else if let (Some(x), Some(y)) = (seq_len(a), seq_len(b)) {
        check_items(x.checked_add(y), "`+`")?;
    }
    Ok(pass(a, b))
}

fn check_mul(a: &Value, b: &Value) -> Result<Value, Error> {
    for (x, n) in [(a, b), (b, a)] {
        let Some(n) = n.as_usize() else { continue };
        if let Some(s) = x.as_str() {
            charge(s.len().saturating_mul(n), "`*`")?;
        } else if let Some(len) = seq_len(x) {
            check_items(len.checked_mul(n), "`*`")?;
        }
    }
    Ok(pass(a, b))
}

fn check_stored(value: Value) -> Result<Value, Error> {
    if matches!(
        value.kind(),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
    ) && printed_size(&value, usize::MAX, 0, 0).is_none()
    {
        return Err(limit_error(format!(
            "a variable would hold a value nested deeper than {MAX_DEPTH} levels"
        )));
    }
    Ok(value)
}

fn check_set_attr(value: &Value, target: &Value) -> Result<Value, Error> {
    let value = check_stored(value.clone())?;
    Ok(pass(&value, target))
}

fn tick() -> Result<Value, Error> {
    check_deadline()?;
    Ok(Value::UNDEFINED)
}

// Names a template cannot assign (they are not identifiers), so it cannot shadow them.
const CONCAT: &str = "ni:concat";
const ADD: &str = "ni:add";
const MUL: &str = "ni:mul";
const STORE: &str = "ni:store";
const SET_ATTR: &str = "ni:set_attr";
const TICK: &str = "ni:tick";

/// Checks a template's source before minijinja compiles it and defuses constant
/// folding of repetition: minijinja evaluates `'x' * 99999999` or `[0] * 10**9`
/// at compile time, where no budget applies, so in a tag holding `*` or `**` each
/// number literal becomes `(N|int)`, which is not folded; the repetition then runs
/// through the checked `*` at render time.
pub fn prepare(source: &str, ws: WhitespaceConfig) -> Result<String, String> {
    let mut numbers = Vec::new(); // (start, end, filter) of number literals to wrap
    let mut tag_numbers = Vec::new();
    let mut tag_tokens = 0usize;
    let mut tag_repeats = false;
    let mut after_dot = false;
    for item in tokenize(source, false, Default::default(), ws) {
        // A lexing error is reported by the compiler, with its position.
        let Ok((token, span)) = item else { break };
        match token {
            Token::VariableStart | Token::BlockStart => {
                tag_tokens = 0;
                tag_repeats = false;
                tag_numbers.clear();
            }
            Token::VariableEnd | Token::BlockEnd => {
                if tag_repeats {
                    numbers.append(&mut tag_numbers);
                }
                tag_numbers.clear();
            }
            Token::TemplateData(_) => {}
            Token::Mul | Token::Pow => tag_repeats = true,
            Token::Int(_) | Token::Int128(_) | Token::Float(_) if !after_dot => {
                let filter = if matches!(token, Token::Float(_)) {
                    "float"
                } else {
                    "int"
                };
                tag_numbers.push((span.start_offset as usize, span.end_offset as usize, filter))
            }
            _ => {}
        }
        after_dot = matches!(token, Token::Dot);
        tag_tokens += 1;
        if tag_tokens > MAX_TAG_TOKENS {
            return Err(format!(
                "a tag on line {} has more than {MAX_TAG_TOKENS} tokens",
                span.start_line
            ));
        }
    }
    let mut out = String::with_capacity(source.len() + numbers.len() * 8);
    let mut at = 0;
    for (start, end, filter) in numbers {
        let (Some(before), Some(number)) = (source.get(at..start), source.get(start..end)) else {
            continue;
        };
        out.push_str(before);
        out.push('(');
        out.push_str(number);
        out.push('|');
        out.push_str(filter);
        out.push(')');
        at = end;
    }
    out.push_str(source.get(at..).unwrap_or_default());
    Ok(out)
}

/// Rewrites a compiled template so that the checks above run (see the module docs).
/// Every jump target is moved to where its instruction now starts.
pub fn harden<'s>(old: &Instructions<'s>) -> Instructions<'s> {
    use Instruction as I;
    let expand = |instr: &I<'s>| -> Vec<I<'s>> {
        let guarded = |check: &'static str, op: I<'s>| {
            vec![I::CallFunction(check, Some(2)), I::UnpackList(2), op]
        };
        let ticked = |op: I<'s>| vec![I::CallFunction(TICK, Some(0)), I::DiscardTop, op];
        match instr {
            I::EmitRaw(text) => vec![I::LoadConst(Value::from(*text)), I::Emit],
            I::StringConcat => guarded(CONCAT, I::StringConcat),
            I::Add => guarded(ADD, I::Add),
            I::Mul => guarded(MUL, I::Mul),
            I::SetAttr(name) => guarded(SET_ATTR, I::SetAttr(name)),
            I::StoreLocal(name) => vec![I::CallFunction(STORE, Some(1)), I::StoreLocal(name)],
            I::Iterate(_)
            | I::CallFunction(..)
            | I::CallMethod(..)
            | I::CallObject(_)
            | I::ApplyFilter(..) => ticked(instr.clone()),
            other => vec![other.clone()],
        }
    };
    let len = old.len() as u32;
    let groups: Vec<Vec<I<'s>>> = (0..len)
        .map(|i| old.get(i).map(expand).unwrap_or_default())
        .collect();
    let mut start = Vec::with_capacity(groups.len() + 1);
    let mut next = 0u32;
    for g in &groups {
        start.push(next);
        next += g.len() as u32;
    }
    start.push(next);
    let target = |t: &u32| start.get(*t as usize).copied().unwrap_or(next);
    let mut new = Instructions::new(old.name(), old.source());
    for (i, group) in groups.into_iter().enumerate() {
        let span = old.get_span(i as u32);
        let line = old.get_line(i as u32);
        for instr in group {
            let instr = match instr {
                I::Jump(t) => I::Jump(target(&t)),
                I::JumpIfFalse(t) => I::JumpIfFalse(target(&t)),
                I::JumpIfFalseOrPop(t) => I::JumpIfFalseOrPop(target(&t)),
                I::JumpIfTrueOrPop(t) => I::JumpIfTrueOrPop(target(&t)),
                I::Iterate(t) => I::Iterate(target(&t)),
                I::BuildMacro(name, t, flags) => I::BuildMacro(name, target(&t), flags),
                other => other,
            };
            match (span, line) {
                (Some(span), _) => new.add_with_span(instr, span),
                (None, Some(line)) => new.add_with_line(instr, line.min(u16::MAX as usize) as u16),
                (None, None) => new.add(instr),
            };
        }
    }
    new
}

/// Registers the checks [`harden`] calls and the bounded filters.
pub fn install(env: &mut Environment<'_>) {
    env.set_fuel(Some(FUEL));
    env.set_recursion_limit(MAX_RECURSION);
    env.add_function(CONCAT, |a: Value, b: Value| check_concat(&a, &b));
    env.add_function(ADD, |a: Value, b: Value| check_add(&a, &b));
    env.add_function(MUL, |a: Value, b: Value| check_mul(&a, &b));
    env.add_function(SET_ATTR, |a: Value, b: Value| check_set_attr(&a, &b));
    env.add_function(STORE, check_stored);
    env.add_function(TICK, tick);
    env.add_filter("format", format_filter);
    env.add_filter("indent", indent_filter);
    env.add_filter("join", join_filter);
    env.add_filter("replace", replace_filter);
    env.add_filter("string", string_filter);
    env.add_filter("pprint", pprint_filter);
    env.add_filter(
        "batch",
        |state: &State, v: Value, n: usize, fill: Option<Value>| {
            check_items(Some(n), "batch")?;
            minijinja::filters::batch(state, v, n, fill)
        },
    );
    env.add_filter(
        "slice",
        |state: &State, v: Value, n: usize, fill: Option<Value>| {
            check_items(Some(n), "slice")?;
            minijinja::filters::slice(state, v, n, fill)
        },
    );
    env.set_unknown_method_callback(method_callback);
}

/// The widths and precisions of a format string's fields, and how many fields it has.
/// printf style: `%[(key)][flags][width][.precision]type`; str.format style:
/// `{[field][!conv][:spec]}` where the spec's numbers are the width and precision.
fn format_fields(fmt: &str, printf: bool) -> Result<(usize, usize), Error> {
    let bytes = fmt.as_bytes();
    let mut fields = 0usize;
    let mut widest = 0usize;
    let mut check_number = |digits: &[u8]| -> Result<(), Error> {
        let n = std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse::<usize>().ok())
            .unwrap_or(usize::MAX);
        if n > MAX_WIDTH {
            return Err(limit_error(format!(
                "format width or precision {} is over the limit of {MAX_WIDTH}",
                String::from_utf8_lossy(digits)
            )));
        }
        widest = widest.max(n);
        Ok(())
    };
    let mut i = 0;
    while i < bytes.len() {
        let (open, close) = if printf {
            (b'%', None)
        } else {
            (b'{', Some(b'}'))
        };
        if bytes[i] != open {
            i += 1;
            continue;
        }
        if bytes.get(i + 1) == Some(&open) {
            i += 2;
            continue;
        }
        fields += 1;
        let mut j = i + 1;
        let end = match close {
            Some(c) => bytes[j..]
                .iter()
                .position(|&b| b == c)
                .map_or(bytes.len(), |p| j + p),
            None => {
                if bytes.get(j) == Some(&b'(') {
                    j = bytes[j..]
                        .iter()
                        .position(|&b| b == b')')
                        .map_or(bytes.len(), |p| j + p);
                }
                let spec_end = bytes[j..]
                    .iter()
                    .position(|b| b.is_ascii_alphabetic())
                    .map_or(bytes.len(), |p| j + p);
                spec_end
            }
        };
        if !printf {
            // Only the part after ':' is a spec; the field name may hold digits.
            j = bytes[j..end]
                .iter()
                .position(|&b| b == b':')
                .map_or(end, |p| j + p);
        }
        let mut k = j;
        while k < end {
            if bytes[k].is_ascii_digit() {
                let s = k;
                while k < end && bytes[k].is_ascii_digit() {
                    k += 1;
                }
                check_number(&bytes[s..k])?;
            } else {
                k += 1;
            }
        }
        i = end.max(i + 1);
    }
    Ok((fields, widest))
}

/// Prices a format call: the format string plus, per field, its width and the
/// longest argument printed (an argument may be used by several fields).
fn charge_format(fmt: &str, args: &[Value], printf: bool) -> Result<(), Error> {
    let (fields, widest) = format_fields(fmt, printf)?;
    let mut longest = 0usize;
    for arg in args {
        longest = longest.max(priced(arg, 4, 4, "format")?);
    }
    let bound = fields
        .saturating_mul(widest.saturating_add(longest).saturating_add(64))
        .saturating_add(fmt.len());
    charge(bound, "format")
}

fn format_filter(state: &State, fmt: &Value, args: Rest<Value>) -> Result<Value, Error> {
    if let Some(s) = fmt.as_str() {
        charge_format(s, &args, true)?;
    }
    minijinja::filters::format(state, fmt, args)
}

fn indent_filter(
    value: StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let w = match width {
        Some(w) => Some(w),
        None => kwargs.peek::<Option<usize>>("width")?,
    };
    if let Some(w) = w {
        if w > MAX_WIDTH {
            return Err(limit_error(format!(
                "indent width {w} is over the limit of {MAX_WIDTH}"
            )));
        }
        let s = value.as_str();
        let lines = s.bytes().filter(|&b| b == b'\n').count() + 1;
        charge(s.len().saturating_add(lines.saturating_mul(w)), "indent")?;
    }
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

fn charge_join(items: &Value, sep_len: usize, what: &str) -> Result<(), Error> {
    let Ok(iter) = items.try_iter() else {
        return Ok(()); // minijinja reports the type error
    };
    let mut total = 0usize;
    for (i, item) in iter.enumerate() {
        if i >= MAX_ITEMS {
            check_items(None, what)?;
        }
        let size = match item.as_str() {
            Some(s) => s.len(),
            None => priced(&item, 4, 4, what)?,
        };
        total = total.saturating_add(size).saturating_add(sep_len);
        if total > remaining() {
            break;
        }
    }
    charge(total, what)
}

fn join_filter(state: &State, value: &Value, sep: Option<StringInput<'_>>) -> Result<Value, Error> {
    charge_join(value, sep.as_ref().map_or(0, |s| s.as_str().len()), "join")?;
    minijinja::filters::join(state, value, sep)
}

/// `s.replace(old, new)` grows by `(new - old)` bytes per occurrence.
fn charge_replace(s: &str, old: &str, new: &str, what: &str) -> Result<(), Error> {
    let hits = if old.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(old).count()
    };
    let size = s
        .len()
        .saturating_add(hits.saturating_mul(new.len()))
        .saturating_sub(hits.saturating_mul(old.len()));
    charge(size, what)
}

fn replace_filter(
    state: &State,
    value: StringInput<'_>,
    from: StringInput<'_>,
    to: StringInput<'_>,
) -> Result<Value, Error> {
    charge_replace(value.as_str(), from.as_str(), to.as_str(), "replace")?;
    minijinja::filters::replace(state, value, from, to)
}

fn string_filter(state: &State, value: &Value) -> Result<Value, Error> {
    if value.kind() != ValueKind::String {
        charge(priced(value, 4, 4, "string")?, "string")?;
    }
    minijinja::filters::string(state, value)
}

fn pprint_filter(value: &Value) -> Result<String, Error> {
    // Pretty printing indents every item by its depth.
    charge(priced(value, 4, 4 * MAX_DEPTH, "pprint")?, "pprint")?;
    Ok(minijinja::filters::pprint(value))
}

/// pycompat's string, list and map methods, with the amplifying ones priced first.
fn method_callback(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match (method, args) {
            ("format", _) => charge_format(s, args, false)?,
            ("join", [items]) => charge_join(items, s.len(), "join")?,
            ("replace", [old, new, ..]) => {
                if let (Some(old), Some(new)) = (old.as_str(), new.as_str()) {
                    charge_replace(s, old, new, "replace")?;
                }
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_fields_find_widths() {
        assert_eq!(format_fields("%s and %5d %%", true).unwrap(), (2, 5));
        assert_eq!(format_fields("%(a)10.3f", true).unwrap(), (1, 10));
        assert!(format_fields("%999999999999999s", true).is_err());
        assert_eq!(format_fields("{0} {1:>12} {{x}}", false).unwrap(), (2, 12));
        assert!(format_fields("{:^99999}", false).is_err());
        assert!(format_fields("{:.100000f}", false).is_err());
    }

    #[test]
    fn printed_size_bounds_depth() {
        let mut v = Value::from(1);
        for _ in 0..MAX_DEPTH + 1 {
            v = Value::from(vec![v]);
        }
        assert!(printed_size(&v, usize::MAX, 1, 1).is_none());
        assert!(printed_size(&Value::from("abc"), 100, 4, 4) == Some(12));
    }
}
