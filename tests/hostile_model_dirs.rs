//! Hostile model directories: each is the default model with one file replaced
//! (a FIFO, a device, an oversized file, a hostile chat template). Loading it
//! through the Rust API, the C ABI and the CLI must fail (or, for optional files,
//! succeed) quickly with a message naming the file and the limit, never hang,
//! abort or read without bound. The CLI runs under an address-space limit, so a
//! ballooning read fails the test instead of the machine.

mod ffi_common;

use nanoinfer::engine::model::{Model, ModelParams};
use nanoinfer::ffi::*;
use nanoinfer::tokenizer::ChatMessage;
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

const TIME_LIMIT: Duration = Duration::from_secs(60);
const CLI_ADDRESS_SPACE: libc::rlim_t = 8 << 30;

/// Runs `f` on a thread and fails the test if it does not return in time.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(TIME_LIMIT)
        .unwrap_or_else(|_| panic!("{what} did not return within {TIME_LIMIT:?}"))
}

/// The default model's files, symlinked into a fresh directory, minus `replace`.
fn model_dir_without(name: &str, replace: &str) -> PathBuf {
    let src = ffi_common::model_dir();
    let dir = std::env::temp_dir().join(format!("ni-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != replace {
            let target = std::fs::canonicalize(entry.path()).unwrap();
            std::os::unix::fs::symlink(target, dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: c is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

fn rust_load(dir: &Path) -> nanoinfer::Result<Model> {
    let dir = dir.to_path_buf();
    let params = ModelParams {
        threads: 2,
        ..Default::default()
    };
    bounded("Model::load", move || Model::load(&dir, &params, None))
}

fn ffi_load(dir: &Path) -> (ni_status, String) {
    let dir = dir.to_path_buf();
    bounded("ni_model_load", move || {
        let (status, msg, model) = ffi_common::try_load_model_at(&dir);
        // SAFETY: model is null on failure or a handle from ni_model_load.
        unsafe { ni_model_free(model) };
        (status, msg)
    })
}

/// `nanoinfer generate` on `dir`, under an address-space limit: (exit code, stderr).
fn cli_generate(dir: &Path) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nanoinfer"));
    cmd.args(["generate", "--model", dir.to_str().unwrap()])
        .args(["--prompt", "hi", "--max-tokens", "1", "--threads", "2"]);
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: CLI_ADDRESS_SPACE,
                rlim_max: CLI_ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = bounded("nanoinfer generate", move || cmd.output().unwrap());
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A directory whose `file` is replaced must fail to load everywhere with an
/// InvalidModel error mentioning every needle.
fn assert_refused(name: &str, file: &str, make: impl Fn(&Path), needles: &[&str]) {
    let dir = model_dir_without(name, file);
    make(&dir.join(file));
    let check = |msg: &str, via: &str| {
        for n in needles {
            assert!(msg.contains(n), "{via}: {msg:?} should mention {n:?}");
        }
    };
    let Err(err) = rust_load(&dir) else {
        panic!("hostile directory {name} loads");
    };
    assert_eq!(
        err.kind,
        nanoinfer::ErrorKind::InvalidModel,
        "{}",
        err.message
    );
    check(&err.message, "Rust API");
    let (status, msg) = ffi_load(&dir);
    assert_eq!(status, NI_ERR_INVALID_MODEL, "{msg}");
    check(&msg, "C ABI");
    let (code, stderr) = cli_generate(&dir);
    assert_eq!(code, 1, "{stderr}");
    check(&stderr, "CLI");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fifo_config_is_refused_without_blocking() {
    assert_refused(
        "fifo-config",
        "config.json",
        mkfifo,
        &["config.json", "FIFO"],
    );
}

#[test]
fn fifo_weights_are_refused_without_blocking() {
    assert_refused(
        "fifo-weights",
        "model.safetensors",
        mkfifo,
        &["model.safetensors", "FIFO"],
    );
}

#[test]
fn device_tokenizer_is_not_read() {
    let link = |p: &Path| std::os::unix::fs::symlink("/dev/zero", p).unwrap();
    assert_refused(
        "dev-tokenizer",
        "tokenizer.json",
        link,
        &["tokenizer.json", "character device"],
    );
}

#[test]
fn oversized_tokenizer_config_is_refused() {
    // Sparse: the size is what matters, not the bytes.
    let big = |p: &Path| {
        let f = std::fs::File::create(p).unwrap();
        f.set_len(nanoinfer::untrusted_file::MAX_CONFIG_BYTES + 1)
            .unwrap();
    };
    assert_refused(
        "big-tokenizer-config",
        "tokenizer_config.json",
        big,
        &["tokenizer_config.json", "limit"],
    );
}

#[test]
fn fifo_generation_config_is_skipped() {
    let dir = model_dir_without("fifo-genconfig", "generation_config.json");
    mkfifo(&dir.join("generation_config.json"));
    rust_load(&dir).expect("an unreadable optional file does not stop the load");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A hostile chat template loads (it compiles), and rendering fails fast with
/// the file and the limit named, through the Rust API, the C ABI
/// (`ni_apply_chat_template`) and the CLI (`generate --chat`).
#[test]
fn hostile_chat_templates_fail_to_render() {
    let templates = [
        (
            "{% set ns = namespace(s='x') %}{% for i in range(100) %}\
             {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "render budget",
        ),
        ("{{ '%999999999999999s' | format('x') }}", "format width"),
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
            "step limit",
        ),
        (
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "recursion limit",
        ),
    ];
    for (i, (source, limit)) in templates.into_iter().enumerate() {
        let dir = model_dir_without(&format!("template-{i}"), "chat_template.jinja");
        std::fs::write(dir.join("chat_template.jinja"), source).unwrap();
        let model = rust_load(&dir).expect("template compiles");
        let tok = model.tokenizer.expect("tokenizer");
        let err = bounded("render", move || {
            tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true)
        })
        .unwrap_err();
        let check = |msg: &str, via: &str| {
            assert!(
                msg.contains("chat_template.jinja") && msg.contains(limit),
                "{via}: {msg}"
            );
        };
        check(&err.message, "Rust API");
        let (status, msg) = ffi_render(&dir, &[("user", "hi")]);
        assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{msg}");
        check(&msg, "C ABI");
        let (code, stderr) = cli_chat(&dir);
        assert_eq!(code, 1, "{stderr}");
        check(&stderr, "CLI");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `ni_apply_chat_template` of `messages` on the model in `dir`: (status,
/// the error message or the rendered text's length).
fn ffi_render(dir: &Path, messages: &[(&str, &str)]) -> (ni_status, String) {
    let dir = dir.to_path_buf();
    let owned: Vec<(CString, CString)> = messages
        .iter()
        .map(|(r, c)| (CString::new(*r).unwrap(), CString::new(*c).unwrap()))
        .collect();
    bounded("ni_apply_chat_template", move || {
        let (status, msg, model) = ffi_common::try_load_model_at(&dir);
        assert_eq!(status, NI_OK, "{msg}");
        let msgs: Vec<ni_chat_message> = owned
            .iter()
            .map(|(r, c)| ni_chat_message {
                role: r.as_ptr(),
                content: c.as_ptr(),
            })
            .collect();
        let (mut text, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a live model, `msgs.len()` valid messages whose strings
        // outlive the call, valid out pointers.
        let status = unsafe {
            ni_apply_chat_template(model, msgs.as_ptr(), msgs.len(), true, &mut text, &mut len)
        };
        let out = if status == NI_OK {
            len.to_string()
        } else {
            ffi_common::last_error()
        };
        // SAFETY: text is NULL or a string from ni_apply_chat_template;
        // model is a handle from ni_model_load.
        unsafe {
            ni_string_free(text);
            ni_model_free(model);
        }
        (status, out)
    })
}

/// `nanoinfer generate --chat` on `dir`: (exit code, stderr).
fn cli_chat(dir: &Path) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nanoinfer"));
    cmd.args(["generate", "--model", dir.to_str().unwrap(), "--chat"])
        .args(["--prompt", "hi", "--max-tokens", "1", "--threads", "2"]);
    let out = bounded("nanoinfer generate --chat", move || cmd.output().unwrap());
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The step limit grows with the conversation: a 60 000-message chat renders
/// with the model's own template (the fixed 2 000 000 steps ran out before),
/// while a template that loops over the messages inside a loop over them
/// still runs out, quickly, naming the allowance it had.
#[test]
fn the_step_limit_scales_with_the_conversation_not_with_a_nested_loop() {
    let turns: Vec<(&str, &str)> = (0..60_000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            (role, "hello there, how are you")
        })
        .collect();
    let (status, rendered) = ffi_render(&ffi_common::model_dir(), &turns);
    assert_eq!(status, NI_OK, "{rendered}");
    assert!(rendered.parse::<usize>().unwrap() > 60_000 * 25);

    let dir = model_dir_without("template-quadratic", "chat_template.jinja");
    let quadratic =
        "{% for a in messages %}{% for b in messages %}{{ '' }}{% endfor %}{% endfor %}";
    std::fs::write(dir.join("chat_template.jinja"), quadratic).unwrap();
    let started = std::time::Instant::now();
    let (status, msg) = ffi_render(&dir, &turns[..5_000]);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{msg}");
    let allowance = nanoinfer::tokenizer::template_step_limit(5_000);
    assert!(
        msg.contains(&format!("step limit of {allowance} instructions")),
        "{msg}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
