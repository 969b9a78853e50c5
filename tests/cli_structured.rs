//! The CLI's structured-output options end to end on SmolLM2:
//! `--json-schema FILE`, `--regex R`, `--grammar FILE`, `--choice A
//! --choice B`, the `unfinished_structure` flag of `--json` output, and
//! their errors.

mod common;

use common::*;
use serde_json::Value;
use std::path::PathBuf;

/// `nanoinfer generate --model SmolLM2 --json ARGS...`: its one JSON line.
fn generate(args: &[&str]) -> Value {
    let dir = smollm2_dir("");
    let mut all = vec!["generate", "--model", dir.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    let (code, out, err) = nanoinfer(&all);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nanoinfer-cli-so-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const SCHEMA: &str = r#"{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"type":"integer","minimum":0,"maximum":9}},"required":["ok","n"],"additionalProperties":false}"#;

#[test]
fn constraint_options_shape_the_output() {
    let schema = temp_file("s.json", SCHEMA);
    let schema = schema.to_str().unwrap();
    let v = generate(&[
        "--chat",
        "--prompt",
        "Status as JSON.",
        "--json-schema",
        schema,
        "--max-tokens",
        "40",
    ]);
    let text = v["text"].as_str().unwrap();
    let out: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(
        out["ok"].is_boolean() && out["n"].as_u64().is_some_and(|n| n <= 9),
        "{text}"
    );
    assert_eq!(out.as_object().unwrap().len(), 2, "{text}");
    assert_eq!(v["finish_reason"], "stop");
    assert!(v.get("unfinished_structure").is_none());

    let v = generate(&[
        "--chat",
        "--prompt",
        "Yes or no?",
        "--choice",
        "yes",
        "--choice",
        "no",
        "--temperature",
        "1.5",
        "--seed",
        "9",
    ]);
    let t = v["text"].as_str().unwrap();
    assert!(t == "yes" || t == "no", "{t:?}");

    let v = generate(&["--prompt", "Code:", "--regex", "[A-Z]{2}[0-9]{3}"]);
    let t = v["text"].as_str().unwrap();
    assert!(
        regex::Regex::new("^[A-Z]{2}[0-9]{3}$").unwrap().is_match(t),
        "{t:?}"
    );

    let grammar = temp_file("g.lark", "start: \"(\" num \")\"\nnum: /[0-9]{1,3}/\n");
    let v = generate(&[
        "--prompt",
        "A number:",
        "--grammar",
        grammar.to_str().unwrap(),
    ]);
    let t = v["text"].as_str().unwrap();
    assert!(
        regex::Regex::new(r"^\([0-9]{1,3}\)$").unwrap().is_match(t),
        "{t:?}"
    );

    // Cut off inside the object: length, flagged as unfinished.
    let v = generate(&[
        "--prompt",
        "x",
        "--json-schema",
        schema,
        "--max-tokens",
        "2",
    ]);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["unfinished_structure"], true);
}

#[test]
fn bad_constraint_options_are_clear_errors() {
    let dir = smollm2_dir("");
    let bad = temp_file("bad.json", r#"{"type": "strnig"}"#);
    let not_json = temp_file("not.json", "{\"type\":");
    for (args, needle) in [
        (vec!["--json-schema", bad.to_str().unwrap()], "json_schema"),
        (
            vec!["--json-schema", not_json.to_str().unwrap()],
            "json_schema is not valid JSON",
        ),
        (
            vec!["--json-schema", "/nonexistent/schema.json"],
            "/nonexistent/schema.json",
        ),
        (vec!["--regex", "(a"], "regex"),
        (vec!["--grammar", "/nonexistent/g.lark"], "--grammar"),
        (vec!["--regex", "a", "--choice", "b"], "at most one"),
    ] {
        let mut all = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
        ];
        all.extend(args.iter().copied());
        let (code, out, err) = nanoinfer(&all);
        assert_ne!(code, 0, "{args:?}: {out}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
