//! Structured output on SmolLM2 (CPU): JSON Schemas, regexes, a Lark
//! grammar and choices under greedy and seeded sampled decoding. Every JSON
//! output is checked with an independent JSON Schema validator (the
//! `jsonschema` crate), regex outputs with the `regex` crate.

mod common;

use common::*;
use nanoinfer::engine::{
    Constraint, FinishReason, Model, RequestParams, Session, SessionParams, TokenLogprob,
};
use nanoinfer::model::WeightDType;
use nanoinfer::sampling::SamplingParams;
use nanoinfer::tokenizer::ChatMessage;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| load_model(&smollm2_dir(""), WeightDType::F32))
        .clone()
}

fn chat(model: &Model, text: &str) -> Vec<u32> {
    let tok = model.tokenizer().unwrap();
    tok.encode_chat(&[ChatMessage::new("user", text)], true, 4096)
        .unwrap()
}

fn request(prompt: Vec<u32>, c: Option<Constraint>, temperature: f32, seed: u64) -> RequestParams {
    RequestParams {
        prompt,
        sampling: SamplingParams {
            temperature,
            seed: Some(seed),
            max_tokens: 200,
            ..Default::default()
        },
        constraint: c,
        ..Default::default()
    }
}

fn session(model: &Arc<Model>) -> Session {
    Session::new(
        model.clone(),
        SessionParams {
            kv_capacity_tokens: 8192,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Every event of a request, gathered: tokens, text, logprobs and finish
/// reason.
#[derive(Debug, Default, Clone)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
}

/// Runs the requests together in `s` until it is idle; each one's outcome.
fn run_in(s: &mut Session, reqs: Vec<RequestParams>) -> Vec<Outcome> {
    let ids: Vec<u64> = reqs
        .into_iter()
        .map(|r| s.add_request(r).unwrap())
        .collect();
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    while s.has_work() {
        for ev in s.step().unwrap() {
            let o = out.entry(ev.request_id).or_default();
            assert!(o.finish.is_none(), "event after the terminal event");
            o.tokens.extend_from_slice(&ev.tokens);
            o.text.push_str(&ev.text);
            o.logprobs.extend(ev.logprobs);
            o.finish = ev.finish;
        }
    }
    s.check_invariants().unwrap();
    ids.iter()
        .map(|id| {
            let o = out.remove(id).unwrap();
            assert!(o.finish.is_some(), "a terminal event");
            o
        })
        .collect()
}

/// Runs the requests together in a fresh session; each one's text and
/// finish reason.
fn run(model: &Arc<Model>, reqs: Vec<RequestParams>) -> Vec<(String, FinishReason)> {
    run_in(&mut session(model), reqs)
        .into_iter()
        .map(|o| (o.text, o.finish.unwrap()))
        .collect()
}

/// The session still works: the text of one more constrained request.
fn serves(s: &mut Session, prompt: Vec<u32>, c: Constraint) -> String {
    s.add_request(request(prompt, Some(c), 0.0, 0)).unwrap();
    let mut text = String::new();
    while s.has_work() {
        for e in s.step().unwrap() {
            text.push_str(&e.text);
        }
    }
    text
}

fn schemas() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "flat object",
            "Give me a user record as JSON with a name, an email and whether they are active.",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "active": {"type": "boolean"}},
             "required": ["name", "email", "active"], "additionalProperties": false}),
        ),
        (
            "nested with arrays and enums",
            "Describe a small software project as JSON: its name, its languages and its team.",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40},
                "languages": {"type": "array", "items": {"enum": ["rust", "go", "python", "c"]},
                              "minItems": 1, "maxItems": 4},
                "team": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                    "person": {"type": "string", "maxLength": 30},
                    "role": {"enum": ["lead", "dev", "qa"]}},
                  "required": ["person", "role"], "additionalProperties": false}}},
             "required": ["name", "languages", "team"], "additionalProperties": false}),
        ),
        (
            "numbers with bounds",
            "Give the weather as JSON: temperature in Celsius, humidity percent and wind speed.",
            json!({"type": "object", "properties": {
                "temperature": {"type": "number", "minimum": -40, "maximum": 50},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind": {"type": "number", "exclusiveMinimum": 0, "maximum": 200}},
             "required": ["temperature", "humidity", "wind"], "additionalProperties": false}),
        ),
        (
            "strings with patterns",
            "Give a product as JSON with a SKU code, a price and a date.",
            json!({"type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "string", "pattern": "^[0-9]{1,4}\\.[0-9]{2}$"},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
             "required": ["sku", "price", "date"], "additionalProperties": false}),
        ),
    ]
}

#[test]
fn json_schema_outputs_parse_and_validate_greedy_and_sampled() {
    let m = model();
    let mut reqs = Vec::new();
    let mut expect = Vec::new();
    for (name, prompt, schema) in schemas() {
        let c = Constraint::JsonSchema(schema.to_string());
        let ids = chat(&m, prompt);
        reqs.push(request(ids.clone(), Some(c.clone()), 0.0, 0));
        expect.push((name, schema.clone(), "greedy".to_string()));
        for seed in 1..=3 {
            reqs.push(request(ids.clone(), Some(c.clone()), 1.0, seed));
            expect.push((name, schema.clone(), format!("T 1.0 seed {seed}")));
        }
    }
    let outs = run(&m, reqs);
    for ((name, schema, how), (text, finish)) in expect.iter().zip(&outs) {
        assert_eq!(*finish, FinishReason::Eos, "{name} ({how}): {text}");
        let v: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{name} ({how}) is not JSON ({e}): {text}"));
        let validator = jsonschema::validator_for(schema).unwrap();
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{name} ({how}): {text}: {errors:?}");
        println!("{name} ({how}): {text}");
    }
}

#[test]
fn regex_choice_and_lark_outputs_match() {
    let m = model();
    let phone = r"\(\d{3}\) \d{3}-\d{4}";
    let lark = "start: num \" + \" num \" = \" num\nnum: /[1-9][0-9]?/\n";
    let choices = vec!["yes".to_string(), "no".to_string(), "maybe".to_string()];
    let mut reqs = Vec::new();
    for (t, seed) in [(0.0, 0), (1.0, 7), (1.5, 8)] {
        reqs.push(request(
            chat(&m, "What is the phone number of the city hall?"),
            Some(Constraint::Regex(phone.into())),
            t,
            seed,
        ));
        reqs.push(request(
            chat(&m, "Is the sky green?"),
            Some(Constraint::Choice(choices.clone())),
            t,
            seed,
        ));
        reqs.push(request(
            chat(&m, "Write an addition of two small numbers and its result."),
            Some(Constraint::Lark(lark.into())),
            t,
            seed,
        ));
    }
    let outs = run(&m, reqs);
    let phone_re = regex::Regex::new(&format!("^{phone}$")).unwrap();
    let sum_re = regex::Regex::new(r"^[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?$").unwrap();
    for chunk in outs.chunks(3) {
        let [(p, pf), (c, cf), (s, sf)] = chunk else {
            unreachable!()
        };
        assert!(phone_re.is_match(p), "regex output {p:?}");
        assert!(choices.contains(c), "choice output {c:?}");
        assert!(sum_re.is_match(s), "grammar output {s:?} ({sf:?})");
        assert_eq!((pf, cf), (&FinishReason::Eos, &FinishReason::Eos));
        println!("regex {p:?} choice {c:?} grammar {s:?}");
    }
}

#[test]
fn length_inside_an_unfinished_structure_says_so() {
    let m = model();
    let (_, prompt, schema) = schemas().remove(1);
    let mut r = request(
        chat(&m, prompt),
        Some(Constraint::JsonSchema(schema.to_string())),
        0.0,
        0,
    );
    r.sampling.max_tokens = 4;
    let mut plain = request(chat(&m, prompt), None, 0.0, 0);
    plain.sampling.max_tokens = 4;
    let outs = run(&m, vec![r, plain]);
    assert_eq!(outs[0].1, FinishReason::LengthUnfinished, "{}", outs[0].0);
    assert_eq!(outs[0].1.as_str(), "length");
    assert_eq!(outs[1].1, FinishReason::Length);
}

/// The mask is per request: in one batch, constrained rows validate and
/// their plain neighbours stay unconstrained prose.
#[test]
fn constrained_and_plain_requests_share_a_batch() {
    let m = model();
    let mut mixed = Vec::new();
    for (i, (_, prompt, schema)) in schemas().into_iter().enumerate() {
        let ids = chat(&m, prompt);
        mixed.push(request(
            ids,
            Some(Constraint::JsonSchema(schema.to_string())),
            0.0,
            0,
        ));
        let mut plain = request(
            chat(&m, &format!("Tell me fact number {i} about owls.")),
            None,
            0.0,
            0,
        );
        plain.sampling.max_tokens = 24;
        mixed.push(plain);
    }
    let outs = run(&m, mixed);
    let schemas = schemas();
    for (i, pair) in outs.chunks(2).enumerate() {
        let (json_text, finish) = &pair[0];
        assert_eq!(*finish, FinishReason::Eos, "{json_text}");
        let v: Value = serde_json::from_str(json_text).unwrap();
        assert!(jsonschema::is_valid(&schemas[i].2, &v), "{json_text}");
        let (text, finish) = &pair[1];
        assert_eq!(*finish, FinishReason::Length);
        assert!(
            text.contains(' ') && !text.trim_start().starts_with('{'),
            "plain request constrained: {text}"
        );
    }
}

#[test]
fn bad_constraints_are_refused_naming_the_problem() {
    let m = model();
    let mut s = session(&m);
    let prompt = chat(&m, "Hi");
    let cases: Vec<(Constraint, &str)> = vec![
        (
            Constraint::JsonSchema("{not json".into()),
            "json_schema is not valid JSON",
        ),
        (
            Constraint::JsonSchema("[1, 2]".into()),
            "json_schema must be a JSON object",
        ),
        (
            Constraint::JsonSchema(r#"{"type": "banana"}"#.into()),
            "json_schema",
        ),
        (Constraint::Regex("(unclosed".into()), "regex"),
        (
            Constraint::Lark("start: undefined_rule\n".into()),
            "grammar",
        ),
        (Constraint::Choice(vec![]), "choice needs 1 to"),
        (Constraint::Choice(vec!["".into()]), "must not be empty"),
        (
            Constraint::Regex("a".repeat(2 << 20)),
            "more than the limit",
        ),
    ];
    for (c, needle) in cases {
        let err = s
            .add_request(request(prompt.clone(), Some(c.clone()), 0.0, 0))
            .expect_err(&format!("{c:?} accepted"));
        assert!(err.message.contains(needle), "{c:?}: {}", err.message);
        assert!(
            !err.message.contains("<state>"),
            "parser dump in: {}",
            err.message
        );
    }
    let mut r = request(prompt.clone(), Some(Constraint::Regex("a+".into())), 0.0, 0);
    r.sampling.ignore_eos = true;
    assert!(s.add_request(r).unwrap_err().message.contains("ignore_eos"));
    let mut r = request(prompt.clone(), Some(Constraint::Regex("a+".into())), 0.0, 0);
    r.sampling.min_tokens = 2;
    assert!(s.add_request(r).unwrap_err().message.contains("min_tokens"));
    // The session still serves.
    assert_eq!(serves(&mut s, prompt, Constraint::Regex("ok".into())), "ok");
}

#[test]
fn hostile_grammars_fail_their_request_not_the_session() {
    let m = model();
    let mut s = session(&m);
    let prompt = chat(&m, "Say something.");
    let hostile = [
        // Nested counted repetition: a lexer too big to build.
        Constraint::Regex("((a{0,200}){0,200}){0,200}".into()),
        // A deeply nested schema.
        Constraint::JsonSchema({
            let mut v = json!({"type": "string"});
            for _ in 0..2000 {
                v = json!({"type": "array", "items": v});
            }
            v.to_string()
        }),
        // An ambiguous grammar whose Earley sets grow with every token.
        Constraint::Lark("start: x\nx: x x | x x x | \"a\" | \"a\" x | x \"a\"\n".into()),
    ];
    for c in hostile {
        let started = Instant::now();
        let mut r = request(prompt.clone(), Some(c.clone()), 1.0, 3);
        r.sampling.max_tokens = 64;
        match s.add_request(r) {
            Err(e) => println!(
                "refused at add_request in {:?}: {}",
                started.elapsed(),
                e.message
            ),
            Ok(id) => {
                let mut finish = None;
                while s.has_work() {
                    for e in s.step().unwrap() {
                        if e.request_id == id && e.finish.is_some() {
                            finish = e.finish;
                        }
                    }
                }
                println!("ran in {:?}: {finish:?}", started.elapsed());
                assert!(finish.is_some());
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{c:?} took {:?}",
            started.elapsed()
        );
        s.check_invariants().unwrap();
    }
    // The session serves the next request normally.
    assert_eq!(
        serves(&mut s, prompt, Constraint::Choice(vec!["fine".into()])),
        "fine"
    );
}

/// Whether `json` has whitespace outside its strings.
fn has_whitespace_between_tokens(json: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            c if c.is_whitespace() && !in_string => return true,
            _ => {}
        }
    }
    false
}

#[test]
fn json_schema_output_is_compact_unless_the_schema_allows_whitespace() {
    let m = model();
    let (_, prompt, schema) = schemas().remove(1);
    let ids = chat(&m, prompt);
    let mut reqs: Vec<RequestParams> = (0..3)
        .map(|seed| {
            request(
                ids.clone(),
                Some(Constraint::JsonSchema(schema.to_string())),
                if seed == 0 { 0.0 } else { 1.0 },
                seed,
            )
        })
        .collect();
    // Other x-guidance options keep the default of no whitespace.
    let mut lenient = schema.clone();
    lenient["x-guidance"] = json!({"lenient": false});
    reqs.push(request(
        ids.clone(),
        Some(Constraint::JsonSchema(lenient.to_string())),
        0.0,
        0,
    ));
    // A schema that asks for flexible whitespace gets it: SmolLM2 greedy
    // pretty-prints this object.
    let mut flexible = schema.clone();
    flexible["x-guidance"] = json!({"whitespace_flexible": true});
    let mut loose = request(
        ids,
        Some(Constraint::JsonSchema(flexible.to_string())),
        0.0,
        0,
    );
    loose.sampling.max_tokens = 60;
    reqs.push(loose);
    let outs = run(&m, reqs);
    for (text, finish) in &outs[..4] {
        assert_eq!(*finish, FinishReason::Eos, "{text}");
        assert!(!has_whitespace_between_tokens(text), "{text:?}");
        let v: Value = serde_json::from_str(text).unwrap();
        assert!(jsonschema::is_valid(&schema, &v), "{text}");
    }
    let (text, _) = &outs[4];
    assert!(has_whitespace_between_tokens(text), "{text:?}");
}

#[test]
fn masks_are_counted_and_batches_match_solo_runs() {
    let m = model();
    let schemas = schemas();
    let constrained = |i: usize| Some(Constraint::JsonSchema(schemas[i].2.to_string()));
    let mut reqs = vec![
        request(chat(&m, schemas[0].1), constrained(0), 0.0, 0),
        request(chat(&m, "Tell me a joke."), None, 0.0, 0),
        request(chat(&m, schemas[1].1), constrained(1), 1.0, 4),
        request(chat(&m, "What is 2+2?"), None, 1.0, 5),
        request(
            chat(&m, "A date?"),
            Some(Constraint::Regex("[0-9]{4}-[0-9]{2}-[0-9]{2}".into())),
            0.0,
            0,
        ),
        request(
            chat(&m, "Yes or no?"),
            Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
            0.7,
            6,
        ),
    ];
    for r in reqs.iter_mut().filter(|r| r.constraint.is_none()) {
        r.sampling.max_tokens = 30;
    }
    let mut s = session(&m);
    let together = run_in(&mut s, reqs.clone());
    // One mask per token of a constrained request (its EOS included).
    let constrained_tokens: usize = reqs
        .iter()
        .zip(&together)
        .filter(|(r, _)| r.constraint.is_some())
        .map(|(_, o)| o.tokens.len())
        .sum();
    let stats = s.stats();
    assert_eq!(stats.constraint_masks as usize, constrained_tokens);
    assert!(stats.constraint_mask_time_ns > 0);
    assert_eq!(stats.constraint_masks_over_budget, 0);
    for (i, r) in reqs.into_iter().enumerate() {
        let solo = run_in(&mut session(&m), vec![r]).remove(0);
        assert_eq!(solo.tokens, together[i].tokens, "request {i}");
        assert_eq!(solo.finish, together[i].finish, "request {i}");
    }
}

/// A Lark grammar of `n` alternatives, each its own two lexemes.
fn wide_grammar(n: usize) -> String {
    let alternatives: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    let mut g = format!("start: {}\n", alternatives.join(" | "));
    for i in 0..n {
        g.push_str(&format!("r{i}: \"a\" r{i} | \"b{i}\"\n"));
    }
    g
}

#[test]
fn a_mask_over_the_time_budget_fails_its_request_not_the_session() {
    // 3 000 alternative lexemes: llguidance's fuel does not count the
    // lexeme-set work, which takes 100-200 ms for the first mask, over the
    // wall-time budget. The request fails at that mask; a plain and a
    // choice request in the same batch finish normally.
    let m = model();
    let mut s = session(&m);
    let mut plain = request(chat(&m, "Say hi."), None, 0.0, 0);
    plain.sampling.max_tokens = 8;
    let started = Instant::now();
    let outs = run_in(
        &mut s,
        vec![
            request(
                chat(&m, "Say b."),
                Some(Constraint::Lark(wide_grammar(3000))),
                0.0,
                0,
            ),
            plain,
            request(
                chat(&m, "Pick."),
                Some(Constraint::Choice(vec!["x".into(), "y".into()])),
                0.0,
                0,
            ),
        ],
    );
    match &outs[0].finish {
        Some(FinishReason::Error(msg)) => {
            assert!(msg.contains("over the budget of 50 ms"), "{msg}");
            assert!(outs[0].tokens.is_empty(), "failed at its first mask");
        }
        other => panic!("the wide grammar finished {other:?}"),
    }
    assert_eq!(outs[1].tokens.len(), 8);
    assert_eq!(outs[2].finish, Some(FinishReason::Eos));
    assert!(
        outs[2].text == "x" || outs[2].text == "y",
        "{}",
        outs[2].text
    );
    assert_eq!(s.stats().constraint_masks_over_budget, 1);
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn logprobs_are_of_the_masked_distribution() {
    let m = model();
    let mut r = request(
        chat(&m, "Is water wet?"),
        Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
        1.0,
        7,
    );
    r.sampling.logprobs = 5;
    let o = run_in(&mut session(&m), vec![r]).remove(0);
    assert!(o.text == "yes" || o.text == "no", "{:?}", o.text);
    let tok = m.tokenizer().unwrap();
    let first = &o.logprobs[0];
    assert!(first.logprob.is_finite());
    let mut mass = 0.0f64;
    for &(id, lp) in &first.top {
        if lp.is_finite() {
            let text = tok.decode(&[id], false).unwrap();
            assert!(
                "yes".starts_with(&text) || "no".starts_with(&text),
                "alternative {text:?} is outside the grammar"
            );
            mass += (lp as f64).exp();
        }
    }
    // Renormalised over the allowed tokens: the few allowed first tokens
    // carry all the mass.
    assert!(mass > 0.99 && mass < 1.0 + 1e-4, "mass {mass}");
    // The last token is the end of sequence, the only one allowed there.
    assert!(o.logprobs.last().unwrap().logprob.abs() < 1e-5);
}

#[test]
fn stop_strings_still_end_a_constrained_request() {
    let m = model();
    let mut r = request(
        chat(&m, "Write three words."),
        Some(Constraint::Regex("[a-z]{3}-[a-z]{3}-[a-z]{3}".into())),
        0.0,
        0,
    );
    r.sampling.stop_strings = vec!["-".into()];
    let o = run_in(&mut session(&m), vec![r]).remove(0);
    assert_eq!(o.finish, Some(FinishReason::StopString(0)));
    assert_eq!(o.text.len(), 3, "{:?}", o.text);
    assert!(
        o.text.bytes().all(|b| b.is_ascii_lowercase()),
        "{:?}",
        o.text
    );
}

#[test]
fn special_token_text_in_a_constraint_is_ordinary_text() {
    // "<|im_end|>" inside a choice is those ten characters, spelled with
    // ordinary tokens; the end-of-turn token itself only ends the output.
    let m = model();
    let choice = "ok<|im_end|>done".to_string();
    let outs = run_in(
        &mut session(&m),
        vec![
            request(
                chat(&m, "Say ok."),
                Some(Constraint::Choice(vec![choice.clone()])),
                0.0,
                0,
            ),
            request(
                chat(&m, "Say ok."),
                Some(Constraint::Regex(r"(ok|no)<\|im_end\|>[a-z]{2}".into())),
                1.0,
                3,
            ),
        ],
    );
    assert_eq!(outs[0].finish, Some(FinishReason::Eos), "{:?}", outs[0]);
    assert_eq!(outs[0].text, choice);
    assert_eq!(outs[1].finish, Some(FinishReason::Eos), "{:?}", outs[1]);
    let re = regex::Regex::new(r"^(ok|no)<\|im_end\|>[a-z]{2}$").unwrap();
    assert!(re.is_match(&outs[1].text), "{:?}", outs[1].text);
    let eos = m.eos_token_ids[0];
    for o in &outs {
        assert_eq!(o.tokens.iter().filter(|&&t| t == eos).count(), 1, "{o:?}");
    }
}
