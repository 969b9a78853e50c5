//! Chat templates rendered by minijinja must match Jinja2 as configured by
//! transformers (goldens from scripts/make_tokenizer_goldens.py).

mod tokenizer_util;

use nanoinfer::tokenizer::{ChatTemplate, SpecialTokens};
use serde_json::Value as Json;
use tokenizer_util::*;

fn special_tokens(map: &Json) -> SpecialTokens {
    let get = |key: &str| map.get(key).and_then(Json::as_str).map(String::from);
    SpecialTokens {
        bos: get("bos_token"),
        eos: get("eos_token"),
        unk: get("unk_token"),
        sep: get("sep_token"),
        pad: get("pad_token"),
        cls: get("cls_token"),
        mask: get("mask_token"),
        additional: map
            .get("additional_special_tokens")
            .and_then(Json::as_array)
            .map(|a| a.iter().map(|t| t.as_str().unwrap().to_string()).collect())
            .unwrap_or_default(),
    }
}

#[test]
fn templates_match_jinja2_goldens() {
    let golden = load_json(&fixture_dir("template_goldens.json"));
    let special = special_tokens(&golden["special_tokens"]);
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 40, "too few template cases: {}", cases.len());
    let mut bad = Vec::new();
    let mut templates_seen = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["template"].as_str().unwrap();
        templates_seen.insert(name.to_string());
        let source = std::fs::read_to_string(fixture_dir("templates").join(name)).unwrap();
        let template = ChatTemplate::new(&source, name, special.clone())
            .unwrap_or_else(|e| panic!("{name} does not compile: {e}"));
        let msgs = messages(&case["messages"]);
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = template.render(&msgs, gen);
        match (got, case.get("text").and_then(Json::as_str)) {
            (Ok(got), Some(want)) if got == want => {}
            (Ok(got), Some(want)) => bad.push(format!(
                "{name} {msgs:?} gen={gen}:\n got {got:?}\nwant {want:?}"
            )),
            (Err(e), Some(_)) => {
                bad.push(format!("{name} {msgs:?} gen={gen}: unexpected error {e}"))
            }
            (Ok(got), None) => bad.push(format!(
                "{name} {msgs:?}: rendered {got:?}, Jinja2 failed: {}",
                case["error"]
            )),
            (Err(e), None) => {
                // Messages raised by the template itself must come through unchanged.
                let want = case["error"].as_str().unwrap();
                if want.starts_with("Conversation roles") && !e.message.contains(want) {
                    bad.push(format!("{name}: error {:?} lacks {want:?}", e.message));
                }
            }
        }
    }
    assert_eq!(
        templates_seen.len(),
        6,
        "templates covered: {templates_seen:?}"
    );
    assert_no_mismatches("template goldens", &bad);
}

#[test]
fn template_is_compiled_once_and_reusable() {
    let source = std::fs::read_to_string(fixture_dir("templates/chatml_tools.jinja")).unwrap();
    let template =
        ChatTemplate::new(&source, "chatml_tools.jinja", SpecialTokens::default()).unwrap();
    let msgs = [nanoinfer::tokenizer::ChatMessage::new("user", "hi")];
    let first = template.render(&msgs, true).unwrap();
    for _ in 0..100 {
        assert_eq!(template.render(&msgs, true).unwrap(), first);
    }
    assert_eq!(
        first,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn undefined_special_tokens_render_empty_like_jinja2() {
    // transformers passes only the special tokens a config sets; others are undefined.
    let template = ChatTemplate::new(
        "[{{ bos_token }}|{{ sep_token }}]",
        "t",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(template.render(&[], false).unwrap(), "[|]");
    let special = SpecialTokens {
        bos: Some("<s>".into()),
        ..Default::default()
    };
    let template = ChatTemplate::new(
        "{{ bos_token }}{% if eos_token is defined %}E{% endif %}",
        "t",
        special,
    )
    .unwrap();
    assert_eq!(template.render(&[], false).unwrap(), "<s>");
}

#[test]
fn trailing_newline_is_dropped_like_keep_trailing_newline_false() {
    let template = ChatTemplate::new("{{ 'x' }}\n", "t", SpecialTokens::default()).unwrap();
    assert_eq!(template.render(&[], false).unwrap(), "x");
    let template = ChatTemplate::new("{{ 'x' }}\n\n", "t", SpecialTokens::default()).unwrap();
    assert_eq!(template.render(&[], false).unwrap(), "x\n");
}
