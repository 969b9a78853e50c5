//! Saved conversations and prefix caches across processes: `nanoinfer
//! generate --save-state` in one process, `--load-state` in another, gives
//! the tokens of one uninterrupted run (greedy and seeded sampled, across
//! KV backends); a prefix cache saved by one process warm-starts another;
//! a corrupt state file fails the command with a message naming it.

mod common;

use common::*;
use serde_json::Value;

/// Runs `generate --json` with `args` and returns its one output object.
fn generate(args: &[&str]) -> Value {
    let dir = smollm2_dir("");
    let mut all = vec![
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--json",
        "--threads",
        "2",
    ];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = nanoinfer(&all);
    assert_eq!(code, 0, "nanoinfer {all:?} failed: {stderr}");
    serde_json::from_str(stdout.lines().next().expect("one JSON line")).expect("JSON output")
}

#[test]
fn a_conversation_saved_by_one_process_continues_in_another() {
    let scratch = scratch_dir("cli-state");
    std::fs::create_dir_all(&scratch).unwrap();
    let state = scratch.join("conversation.nistate");
    let state = state.to_str().unwrap();
    let prompt = [
        "--chat",
        "--prompt",
        "Tell me about rivers.",
        "--ignore-eos",
    ];
    for sampling in [
        &[][..],
        &["--temperature", "0.8", "--top-p", "0.9", "--seed", "77"][..],
    ] {
        fn with<'a>(prompt: &[&'a str], sampling: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
            [prompt, sampling, extra].concat()
        }
        let whole = generate(&with(&prompt, sampling, &["--max-tokens", "30"]));
        let first = generate(&with(
            &prompt,
            sampling,
            &["--max-tokens", "12", "--save-state", state],
        ));
        let ids = |v: &Value| ids(&v["output_ids"]);
        assert_eq!(ids(&first)[..], ids(&whole)[..12]);
        let rest = generate(
            &[
                sampling,
                &["--ignore-eos", "--max-tokens", "18", "--load-state", state],
                &["--kv-backend", "token"],
            ]
            .concat(),
        );
        assert_eq!(ids(&rest)[..], ids(&whole)[12..], "sampling {sampling:?}");
        assert_eq!(
            first["text"].as_str().unwrap().to_string() + rest["text"].as_str().unwrap(),
            whole["text"].as_str().unwrap()
        );
        assert_eq!(
            rest["usage"]["cached_prompt_tokens"],
            whole["usage"]["prompt_tokens"].as_u64().unwrap() + 11
        );
    }
    // A damaged file fails the command, naming the file and the problem.
    let mut bytes = std::fs::read(state).unwrap();
    bytes.truncate(bytes.len() - 5);
    std::fs::write(state, &bytes).unwrap();
    let dir = smollm2_dir("");
    let (code, _, stderr) = nanoinfer(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--load-state",
        state,
    ]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("conversation.nistate") && stderr.contains("truncated"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn a_prefix_cache_saved_by_one_process_warm_starts_another() {
    let scratch = scratch_dir("cli-prefix-cache");
    let cache = scratch.join("cache");
    let cache = cache.to_str().unwrap();
    let system = "Answer as a patient librarian who cites sources. ".repeat(10);
    let prompt = format!("{system}\nQuestion: what is a sonnet?");
    let cold = generate(&[
        "--prompt",
        &prompt,
        "--max-tokens",
        "6",
        "--save-prefix-cache",
        cache,
    ]);
    assert_eq!(cold["usage"]["cached_prompt_tokens"], 0);
    let warm = generate(&[
        "--prompt",
        &prompt,
        "--max-tokens",
        "6",
        "--load-prefix-cache",
        cache,
    ]);
    let prompt_tokens = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = warm["usage"]["cached_prompt_tokens"].as_u64().unwrap();
    assert!(
        cached + 16 >= prompt_tokens,
        "{cached} of {prompt_tokens} cached"
    );
    assert_eq!(warm["output_ids"], cold["output_ids"]);
    let _ = std::fs::remove_dir_all(&scratch);
}
