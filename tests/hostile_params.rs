//! Hostile sizes from a caller: every count or size that reaches an
//! allocation, through the C ABI and the CLI, is a clear error (status, a
//! message naming the field and the limit) within a time bound and without
//! a large allocation; the process keeps running and the session stays usable.
//! Memory is bounded with VmHWM in-process and with RLIMIT_AS on child
//! processes (an allocation the limit refuses would abort them).

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ffi::{c_char, CString};
use std::process::{Command, Output};
use std::ptr;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The tests of this file one at a time: the memory bounds read the
/// process-wide peak RSS.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on a thread and fails the test when it takes more than `secs`.
#[track_caller]
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(_) => panic!("{what} took more than {secs} s"),
    }
}

fn peak_rss() -> usize {
    nanoinfer::sysinfo::peak_rss_bytes().unwrap_or(0)
}

const MIB: usize = 1 << 20;

/// Handles cross the timing threads as integers (they may be used from any thread).
#[derive(Clone, Copy)]
struct ModelPtr(usize);

fn model() -> ModelPtr {
    ModelPtr(shared_model() as usize)
}

impl ModelPtr {
    fn get(self) -> *mut ni_model {
        self.0 as *mut ni_model
    }
}

fn create(m: ModelPtr, p: ni_session_params) -> (ni_status, usize) {
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(m.get(), &p, &mut s) };
    (status, s as usize)
}

#[test]
fn huge_thread_counts_are_refused_before_loading() {
    let _g = serial();
    let max = nanoinfer::limits::max_threads();
    for n in [u32::MAX, 1 << 20, max as u32 + 1] {
        let (status, msg) = within(10, "ni_model_load", move || {
            let path = CString::new(model_dir().to_str().unwrap()).unwrap();
            let mut params = std::mem::MaybeUninit::<ni_model_params>::uninit();
            let mut m = ptr::null_mut();
            // SAFETY: valid pointers; params initialised by ni_model_params_init.
            let status = unsafe {
                ni_model_params_init(params.as_mut_ptr());
                let mut params = params.assume_init();
                params.n_threads = n;
                ni_model_load(path.as_ptr(), &params, &mut m)
            };
            assert!(m.is_null());
            (status, last_error())
        });
        assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{n}: {msg}");
        assert!(
            msg.contains("n_threads") && msg.contains(&format!("limit of {max}")),
            "{msg}"
        );
    }
}

#[test]
fn huge_session_sizes_are_refused_at_creation() {
    let _g = serial();
    let m = model();
    let base = session_params();
    type Edit = fn(&mut ni_session_params);
    let cases: &[(Edit, ni_status, &[&str])] = &[
        (
            |p| p.kv_capacity_tokens = u64::MAX,
            NI_ERR_INVALID_ARGUMENT,
            &["kv_capacity_tokens", "limit"],
        ),
        (
            |p| p.kv_capacity_tokens = 1 << 40,
            NI_ERR_INVALID_ARGUMENT,
            &["kv_capacity_tokens", "limit"],
        ),
        // Under the slot limit, far over any memory: refused, not attempted.
        (
            |p| p.kv_capacity_tokens = 1 << 30,
            NI_ERR_OUT_OF_MEMORY,
            &["kv_capacity_tokens 1073741824 needs", "available"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.kv_memory_bytes = u64::MAX;
            },
            NI_ERR_OUT_OF_MEMORY,
            &["kv_memory_bytes 18446744073709551615", "available"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.kv_memory_bytes = 1 << 50;
            },
            NI_ERR_OUT_OF_MEMORY,
            &["kv_memory_bytes", "available"],
        ),
        (
            |p| p.max_seqs = u32::MAX,
            NI_ERR_INVALID_ARGUMENT,
            &["max_seqs 4294967295", "limit of 65536"],
        ),
        (
            |p| p.max_batched_tokens = u32::MAX,
            NI_ERR_INVALID_ARGUMENT,
            &["max_batched_tokens", "limit of 1048576"],
        ),
        (
            |p| p.prefill_chunk_size = u32::MAX,
            NI_ERR_INVALID_ARGUMENT,
            &["prefill_chunk_size", "limit"],
        ),
        (
            |p| p.block_size = u32::MAX,
            NI_ERR_INVALID_ARGUMENT,
            &["block_size"],
        ),
        (
            |p| p.block_size = 0,
            NI_ERR_INVALID_ARGUMENT,
            &["block_size"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.kv_memory_fraction = f32::NAN;
            },
            NI_ERR_INVALID_ARGUMENT,
            &["kv_memory_fraction"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.kv_memory_fraction = f32::INFINITY;
            },
            NI_ERR_INVALID_ARGUMENT,
            &["kv_memory_fraction"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.memory_utilization = -0.5;
            },
            NI_ERR_INVALID_ARGUMENT,
            &["memory_utilization"],
        ),
        (
            |p| {
                p.kv_capacity_tokens = 0;
                p.memory_utilization = f32::NAN;
            },
            NI_ERR_INVALID_ARGUMENT,
            &["memory_utilization"],
        ),
    ];
    // Load the model before measuring the peak.
    let _ = m.get();
    let before = peak_rss();
    for (i, (edit, expected, needles)) in cases.iter().enumerate() {
        let mut p = base;
        edit(&mut p);
        // The message is thread-local: read it on the calling thread.
        let (status, s, msg) = within(10, "ni_session_create", move || {
            let (status, s) = create(m, p);
            (status, s, last_error())
        });
        assert_eq!(s, 0, "case {i}: no session on failure");
        assert_eq!(status, *expected, "case {i}: {msg}");
        for n in *needles {
            assert!(msg.contains(n), "case {i}: {msg:?} should mention {n:?}");
        }
    }
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 256 * MIB, "peak RSS grew by {} MiB", grown / MIB);
    // Sizes that touch no allocation are accepted, and the model still serves.
    let mut p = base;
    p.aging_steps = u64::MAX;
    p.seed = u64::MAX;
    let (status, s) = create(m, p);
    ok(status);
    let s = s as *mut ni_session;
    add_tokens(s, &[1, 2, 3], 2);
    let out = run_to_completion(s);
    assert_eq!(out.len(), 1);
    assert!(out.values().next().unwrap().events >= 1);
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
}

/// A session with a small KV cache, shared by the request tests.
fn small_session() -> *mut ni_session {
    let mut p = session_params();
    p.kv_capacity_tokens = 8192;
    let (status, s) = create(model(), p);
    ok(status);
    s as *mut ni_session
}

fn add(s: *mut ni_session, r: &ni_request_params) -> (ni_status, String) {
    let mut id = 0;
    // SAFETY: valid pointers; every array in `r` holds its count.
    let status = unsafe { ni_session_add_request(s, r, &mut id) };
    (
        status,
        if status == NI_OK {
            String::new()
        } else {
            last_error()
        },
    )
}

#[test]
fn huge_request_sizes_are_refused_before_copying() {
    let _g = serial();
    let s = small_session();
    let context = 8192;
    let vocab = 49152;
    let many_ids = vec![1u32; vocab + 1];
    let many_bias = vec![
        ni_logit_bias {
            token: 1,
            bias: 1.0
        };
        vocab + 1
    ];
    let stop = CString::new("x").unwrap();
    let many_stops = [stop.as_ptr(); 17];
    let long_stop = CString::new("y".repeat(1 << 20)).unwrap();
    let long_stops = [long_stop.as_ptr()];
    let prompt = [1u32, 2, 3];

    let mut r = request_params();
    r.prompt_tokens = many_ids.as_ptr();
    r.n_prompt_tokens = context + 1;
    let (status, msg) = add(s, &r);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT);
    assert!(
        msg.contains("n_prompt_tokens is 8193") && msg.contains("context length 8192"),
        "{msg}"
    );

    let base = {
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        r.max_tokens = 2;
        r
    };
    let mut r = base;
    r.logit_bias = many_bias.as_ptr();
    r.n_logit_bias = many_bias.len();
    let (status, msg) = add(s, &r);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT);
    assert!(
        msg.contains("n_logit_bias") && msg.contains("49152"),
        "{msg}"
    );

    let mut r = base;
    r.stop_token_ids = many_ids.as_ptr();
    r.n_stop_token_ids = many_ids.len();
    let (status, msg) = add(s, &r);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT);
    assert!(msg.contains("n_stop_token_ids"), "{msg}");

    let mut r = base;
    r.stop_strings = many_stops.as_ptr();
    r.n_stop_strings = many_stops.len();
    let (status, msg) = add(s, &r);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT);
    assert!(
        msg.contains("n_stop_strings is 17") && msg.contains("limit of 16"),
        "{msg}"
    );

    let mut r = base;
    r.stop_strings = long_stops.as_ptr();
    r.n_stop_strings = 1;
    let (status, msg) = add(s, &r);
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT);
    assert!(
        msg.contains("stop_strings[0]") && msg.contains("256"),
        "{msg}"
    );

    for (edit, needle) in [
        (
            (|r: &mut ni_request_params| r.max_tokens = u32::MAX) as fn(&mut _),
            "max_tokens",
        ),
        (|r| r.logprobs = u32::MAX, "logprobs"),
        (|r| r.min_tokens = u32::MAX, "min_tokens"),
        (|r| r.top_k = i32::MIN, "top_k"),
    ] {
        let mut r = base;
        edit(&mut r);
        let (status, msg) = add(s, &r);
        assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{needle}");
        assert!(msg.contains(needle), "{msg}");
    }

    // Nothing leaked into the session: a good request runs to one terminal event.
    let (status, _) = add(s, &base);
    ok(status);
    let out = run_to_completion(s);
    assert_eq!(out.len(), 1);
    let st = {
        // SAFETY: all-zero is a valid stats struct.
        let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
        st.struct_size = size_of::<ni_session_stats>() as u32;
        // SAFETY: valid pointers.
        ok(unsafe { ni_session_get_stats(s, &mut st) });
        st
    };
    assert_eq!(st.kv_used_tokens, 0);
    assert_eq!(
        st.kv_free_tokens + st.kv_cached_tokens,
        st.kv_capacity_tokens
    );
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
}

#[test]
fn huge_text_is_refused_before_tokenizing() {
    let _g = serial();
    let m = model();
    let s = small_session() as usize;
    // 60 MB of prose: tokenizing it all used to take minutes and ~7 GB.
    let text: &'static str = "the quick brown fox jumps over the lazy dog. "
        .repeat(60_000_000 / 45)
        .leak();
    let before = peak_rss();
    let (status, msg) = within(5, "ni_tokenize of 60 MB", move || {
        let mut ids = ptr::null_mut();
        let mut n = 0;
        // SAFETY: valid pointers; the text outlives the call.
        let status = unsafe {
            ni_tokenize(
                m.get(),
                text.as_ptr().cast::<c_char>(),
                text.len(),
                false,
                &mut ids,
                &mut n,
            )
        };
        assert!(ids.is_null());
        (status, last_error())
    });
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{msg}");
    let len = text.len();
    assert!(msg.contains(&format!("text is {len} bytes long")), "{msg}");
    assert!(msg.contains("limit of 8192 tokens"), "{msg}");

    let (status, msg) = within(5, "a 60 MB text prompt", move || {
        let mut r = request_params();
        r.prompt_text = text.as_ptr().cast::<c_char>();
        r.prompt_text_len = text.len();
        add(s as *mut ni_session, &r)
    });
    assert_eq!(status, NI_ERR_INVALID_ARGUMENT, "{msg}");
    assert!(
        msg.contains(&format!("request.prompt_text is {len} bytes")),
        "{msg}"
    );
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 128 * MIB, "peak RSS grew by {} MiB", grown / MIB);

    // Text that fits is still tokenized: the bound refuses only the impossible.
    let fits = &text[..20_000];
    let mut ids = ptr::null_mut();
    let mut n = 0;
    // SAFETY: valid pointers.
    ok(unsafe {
        ni_tokenize(
            m.get(),
            fits.as_ptr().cast(),
            fits.len(),
            false,
            &mut ids,
            &mut n,
        )
    });
    assert!(n > 1000 && n < 8192, "{n}");
    // SAFETY: returned by ni_tokenize, freed once.
    unsafe { ni_tokens_free(ids) };
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s as *mut ni_session) };
}

/// Runs the CLI with `args` under an address-space limit of `as_limit`
/// bytes (None: no limit) and extra environment variables.
fn cli(args: &[&str], as_limit: Option<u64>, env: &[(&str, &str)], secs: u64) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nanoinfer"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(limit) = as_limit {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child before exec.
        unsafe {
            cmd.pre_exec(move || {
                let rl = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &rl) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let started = Instant::now();
    let out = within(secs, &format!("nanoinfer {args:?}"), move || {
        cmd.output().expect("runs nanoinfer")
    });
    assert!(started.elapsed() < Duration::from_secs(secs));
    out
}

/// Asserts a clean failure: exit status 1 (not a signal or a panic's 101)
/// and an error line mentioning every needle.
#[track_caller]
fn assert_cli_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr {stderr:?} should mention {n:?}");
    }
}

fn model_arg() -> String {
    model_dir().to_str().unwrap().to_string()
}

const GIB: u64 = 1 << 30;

#[test]
fn cli_sizes_are_refused_under_an_address_space_limit() {
    let _g = serial();
    let model = model_arg();
    let gen = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
            "--threads",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--threads", "4294967295"],
            &["n_threads 4294967295", "limit"],
        ),
        (
            &["--kv-capacity", "1000000000000"],
            &["kv_capacity_tokens", "limit"],
        ),
        (
            &["--kv-capacity", "40000"],
            &["kv_capacity_tokens 40000 needs", "available"],
        ),
        (&["--max-seqs", "4294967295"], &["max_seqs", "limit"]),
        (
            &["--max-batched-tokens", "18446744073709551615"],
            &["max_batched_tokens", "limit"],
        ),
        (
            &["--prefill-chunk", "4294967296"],
            &["prefill_chunk_size", "limit"],
        ),
        (&["--block-size", "4294967296"], &["block_size"]),
        (&["--memory-utilization", "NaN"], &["memory_utilization"]),
        (&["--max-tokens", "4294967295"], &["max_tokens"]),
    ];
    for (extra, needles) in cases {
        let args = gen(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // 40 000 tokens of KV are 1.7 GiB: more than the limit leaves.
        let out = cli(&args, Some(2 * GIB), &[], 60);
        assert_cli_error(&out, needles);
    }
    // A utilization budget is sized within the limit and runs.
    let args = gen(&["--memory-utilization", "0.5"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = cli(&args, Some(2 * GIB), &[], 60);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let total = stderr
        .split("total ")
        .nth(1)
        .and_then(|t| t.split(" MiB").next())
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no total in {stderr}"));
    assert!(
        total <= 2048.0,
        "total {total} MiB beyond the 2 GiB limit: {stderr}"
    );
    let kv = stderr
        .split("KV ")
        .nth(1)
        .and_then(|t| t.split(" MiB").next())
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no KV size in {stderr}"));
    assert!(kv > 0.0 && kv < 1024.0, "KV {kv} MiB: {stderr}");
}

#[test]
fn cli_thread_spawn_failure_is_an_error() {
    let _g = serial();
    let model = model_arg();
    // Thread stacks of 1 TiB cannot be mapped: the first worker fails.
    let out = cli(
        &[
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "1",
            "--threads",
            "4",
        ],
        None,
        &[("RUST_MIN_STACK", "1099511627776")],
        60,
    );
    assert_cli_error(&out, &["cannot start kernel thread 1 of 4", "n_threads"]);
}

#[test]
fn cli_huge_prompt_and_perplexity_files_are_bounded() {
    let _g = serial();
    let model = model_arg();
    let dir = std::env::temp_dir().join(format!("nanoinfer-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let big = dir.join("big.txt");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(60_000_000 / 45);
    std::fs::write(&big, &text).unwrap();
    let len = text.len();
    drop(text);
    let big = big.to_str().unwrap();
    // Under 2 GiB of address space: tokenizing it all would need ~7 GB.
    let out = cli(
        &[
            "generate",
            "--model",
            &model,
            "--prompts-file",
            big,
            "--max-tokens",
            "1",
            "--threads",
            "2",
        ],
        Some(2 * GIB),
        &[],
        60,
    );
    assert_cli_error(
        &out,
        &[
            &format!("--prompt is {len} bytes long"),
            "limit of 8192 tokens",
        ],
    );
    let out = cli(
        &[
            "perplexity",
            "--model",
            &model,
            "--file",
            big,
            "--max-tokens",
            "64",
            "--threads",
            "2",
            "--json",
        ],
        Some(2 * GIB),
        &[],
        60,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("\"n_tokens\":64"), "{stdout}");
    let out = cli(
        &[
            "perplexity",
            "--model",
            &model,
            "--file",
            big,
            "--max-tokens",
            "18446744073709551615",
        ],
        Some(2 * GIB),
        &[],
        60,
    );
    assert_cli_error(&out, &["--max-tokens 18446744073709551615 exceeds", "8192"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Not run alone: `pool_spawn_failure_leaves_no_thread` runs it in a child
/// process under an address-space limit.
#[test]
#[ignore = "run by pool_spawn_failure_leaves_no_thread in a child process"]
fn pool_spawn_failure_child() {
    use nanoinfer::backend::cpu::ThreadPool;
    let threads = || nanoinfer::sysinfo::thread_count().unwrap();
    let before = threads();
    let vm = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024;
    // Room for a few 2 MiB worker stacks, not for a thousand.
    let limit = vm + 48 * MIB as u64;
    let rl = libc::rlimit {
        rlim_cur: limit,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall on a valid struct; this process runs only this test.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
    let err = ThreadPool::try_new(1000)
        .err()
        .expect("a thousand stacks do not fit");
    assert!(err.message.contains("of 1000"), "{}", err.message);
    let rl = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
    // Joined, not detached: the count is back at once.
    assert_eq!(threads(), before, "workers left running");
    println!("CHILD-OK {}", err.message);
}

#[test]
fn pool_spawn_failure_leaves_no_thread() {
    let out = within(60, "the pool child", || {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "pool_spawn_failure_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .output()
            .unwrap()
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD-OK cannot start kernel thread"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a hostile request must come to: refused naming a field, or (a
/// value that means something) accepted and ended with one terminal event.
enum Outcome {
    Refused(&'static str),
    Runs,
}

/// Request fields one at a time, each a value a careless or hostile
/// caller could pass: NaN and infinite floats, out-of-range ids and
/// enums, null pointers with non-zero counts, invalid UTF-8. After the
/// table the session still serves and holds no KV.
#[test]
fn hostile_request_fields_are_refused_or_run_cleanly() {
    use Outcome::*;
    let _g = serial();
    let s = small_session();
    let prompt = [1u32, 2, 3];
    let base = {
        let mut r = request_params();
        r.prompt_tokens = prompt.as_ptr();
        r.n_prompt_tokens = prompt.len();
        r.max_tokens = 2;
        r
    };
    let vocab = 49152u32;
    let out_of_vocab = [1u32, vocab, 2];
    let bad_bias = [ni_logit_bias {
        token: vocab,
        bias: 1.0,
    }];
    let nan_bias = [ni_logit_bias {
        token: 5,
        bias: f32::NAN,
    }];
    let inf_bias = [ni_logit_bias {
        token: 5,
        bias: f32::INFINITY,
    }];
    let ban_bias = [ni_logit_bias {
        token: 5,
        bias: f32::NEG_INFINITY,
    }];
    let bad_utf8 = [b'a', 0xff, 0xfe, b'b'];
    let null_stop: [*const c_char; 1] = [ptr::null()];
    let empty = CString::new("").unwrap();
    let empty_stop = [empty.as_ptr()];
    let bad_grammar = CString::new("root ::= (").unwrap();
    let null_msg = [ni_chat_message {
        role: ptr::null(),
        content: ptr::null(),
    }];
    type Edit<'a> = Box<dyn Fn(&mut ni_request_params) + 'a>;
    let cases: Vec<(&str, Edit<'_>, Outcome)> = vec![
        (
            "temperature NaN",
            Box::new(|r| r.temperature = f32::NAN),
            Refused("temperature"),
        ),
        (
            "temperature -1",
            Box::new(|r| r.temperature = -1.0),
            Refused("temperature"),
        ),
        (
            "temperature inf",
            Box::new(|r| r.temperature = f32::INFINITY),
            Refused("temperature"),
        ),
        (
            "top_p NaN",
            Box::new(|r| r.top_p = f32::NAN),
            Refused("top_p"),
        ),
        ("top_p 1.5", Box::new(|r| r.top_p = 1.5), Refused("top_p")),
        ("top_p -0.5", Box::new(|r| r.top_p = -0.5), Refused("top_p")),
        (
            "min_p NaN",
            Box::new(|r| r.min_p = f32::NAN),
            Refused("min_p"),
        ),
        ("min_p 2", Box::new(|r| r.min_p = 2.0), Refused("min_p")),
        ("min_p -1", Box::new(|r| r.min_p = -1.0), Refused("min_p")),
        (
            "repetition_penalty NaN",
            Box::new(|r| r.repetition_penalty = f32::NAN),
            Refused("repetition_penalty"),
        ),
        (
            "repetition_penalty -1",
            Box::new(|r| r.repetition_penalty = -1.0),
            Refused("repetition_penalty"),
        ),
        (
            "repetition_penalty inf",
            Box::new(|r| r.repetition_penalty = f32::INFINITY),
            Refused("repetition_penalty"),
        ),
        (
            "presence_penalty NaN",
            Box::new(|r| r.presence_penalty = f32::NAN),
            Refused("presence_penalty"),
        ),
        (
            "presence_penalty inf",
            Box::new(|r| r.presence_penalty = f32::INFINITY),
            Refused("presence_penalty"),
        ),
        (
            "frequency_penalty NaN",
            Box::new(|r| r.frequency_penalty = f32::NAN),
            Refused("frequency_penalty"),
        ),
        (
            "frequency_penalty -inf",
            Box::new(|r| r.frequency_penalty = f32::NEG_INFINITY),
            Refused("frequency_penalty"),
        ),
        ("top_k -2", Box::new(|r| r.top_k = -2), Refused("top_k")),
        ("top_k i32::MAX", Box::new(|r| r.top_k = i32::MAX), Runs),
        (
            "prompt id past the vocabulary",
            Box::new(|r| {
                r.prompt_tokens = out_of_vocab.as_ptr();
                r.n_prompt_tokens = out_of_vocab.len();
            }),
            Refused("49152"),
        ),
        (
            "null prompt_tokens with a count",
            Box::new(|r| r.prompt_tokens = ptr::null()),
            Refused("prompt_tokens"),
        ),
        (
            "empty prompt",
            Box::new(|r| r.n_prompt_tokens = 0),
            Refused("prompt"),
        ),
        (
            "prompt text not UTF-8",
            Box::new(|r| {
                r.prompt_tokens = ptr::null();
                r.n_prompt_tokens = 0;
                r.prompt_text = bad_utf8.as_ptr().cast();
                r.prompt_text_len = bad_utf8.len();
            }),
            Refused("UTF-8"),
        ),
        (
            "null prompt_text with a length",
            Box::new(|r| {
                r.prompt_tokens = ptr::null();
                r.n_prompt_tokens = 0;
                r.prompt_text = ptr::null();
                r.prompt_text_len = 5;
            }),
            Refused("prompt_text"),
        ),
        (
            "logit_bias id past the vocabulary",
            Box::new(|r| {
                r.logit_bias = bad_bias.as_ptr();
                r.n_logit_bias = 1;
            }),
            Refused("logit_bias"),
        ),
        (
            "logit_bias NaN",
            Box::new(|r| {
                r.logit_bias = nan_bias.as_ptr();
                r.n_logit_bias = 1;
            }),
            Refused("logit_bias"),
        ),
        (
            "logit_bias +inf",
            Box::new(|r| {
                r.logit_bias = inf_bias.as_ptr();
                r.n_logit_bias = 1;
            }),
            Refused("logit_bias"),
        ),
        (
            "logit_bias -inf (outside [-100, 100])",
            Box::new(|r| {
                r.logit_bias = ban_bias.as_ptr();
                r.n_logit_bias = 1;
            }),
            Refused("logit_bias"),
        ),
        (
            "null logit_bias with a count",
            Box::new(|r| r.n_logit_bias = 3),
            Refused("logit_bias"),
        ),
        (
            "null stop_token_ids with a count",
            Box::new(|r| r.n_stop_token_ids = 2),
            Refused("stop_token_ids"),
        ),
        (
            "stop id past the vocabulary",
            Box::new(|r| {
                r.stop_token_ids = out_of_vocab.as_ptr();
                r.n_stop_token_ids = out_of_vocab.len();
            }),
            Refused("stop_token_ids"),
        ),
        (
            "null stop_strings with a count",
            Box::new(|r| r.n_stop_strings = 1),
            Refused("stop_strings"),
        ),
        (
            "a null stop string",
            Box::new(|r| {
                r.stop_strings = null_stop.as_ptr();
                r.n_stop_strings = 1;
            }),
            Refused("stop_strings[0]"),
        ),
        (
            "an empty stop string",
            Box::new(|r| {
                r.stop_strings = empty_stop.as_ptr();
                r.n_stop_strings = 1;
            }),
            Refused("stop_strings[0]"),
        ),
        (
            "max_tokens 0",
            Box::new(|r| r.max_tokens = 0),
            Refused("max_tokens"),
        ),
        (
            "min_tokens over max_tokens",
            Box::new(|r| r.min_tokens = 5),
            Refused("min_tokens"),
        ),
        (
            "priority extremes",
            Box::new(|r| r.priority = i32::MIN),
            Runs,
        ),
        (
            "priority extremes",
            Box::new(|r| r.priority = i32::MAX),
            Runs,
        ),
        (
            "seed u64::MAX",
            Box::new(|r| {
                r.seed = u64::MAX;
                r.use_seed = true;
                r.temperature = 1.0;
            }),
            Runs,
        ),
        (
            "constraint kind out of range",
            Box::new(|r| {
                r.constraint_kind = 999;
            }),
            Refused("constraint_kind"),
        ),
        (
            "grammar that does not parse",
            Box::new(|r| {
                r.constraint = bad_grammar.as_ptr();
                r.constraint_kind = NI_CONSTRAINT_GRAMMAR;
            }),
            Refused("grammar"),
        ),
        (
            "null choices with a count",
            Box::new(|r| {
                r.n_choices = 2;
                r.constraint_kind = NI_CONSTRAINT_CHOICE;
            }),
            Refused("choices"),
        ),
        (
            "null messages with a count",
            Box::new(|r| {
                r.prompt_tokens = ptr::null();
                r.n_prompt_tokens = 0;
                r.n_messages = 2;
            }),
            Refused("messages"),
        ),
        (
            "a message without a role",
            Box::new(|r| {
                r.prompt_tokens = ptr::null();
                r.n_prompt_tokens = 0;
                r.messages = null_msg.as_ptr();
                r.n_messages = 1;
            }),
            Refused("role"),
        ),
        (
            "struct_size 0",
            Box::new(|r| r.struct_size = 0),
            Refused("struct_size"),
        ),
        (
            "struct_size past this library's",
            Box::new(|r| r.struct_size = 1 << 20),
            Refused("struct_size"),
        ),
    ];
    let mut failures = Vec::new();
    for (what, edit, outcome) in &cases {
        let mut r = base;
        edit(&mut r);
        let (status, msg) = add(s, &r);
        match outcome {
            Refused(needle) => {
                if status != NI_ERR_INVALID_ARGUMENT || !msg.contains(needle) {
                    failures.push(format!(
                        "{what}: status {status}, {msg:?} (wanted a refusal naming {needle:?})"
                    ));
                }
            }
            Runs => {
                if status != NI_OK {
                    failures.push(format!("{what}: refused with {status}: {msg}"));
                    continue;
                }
                let out = run_to_completion(s);
                let ended = out.values().filter(|c| c.finish != NI_FINISH_NONE).count();
                if out.len() != 1 || ended != 1 {
                    failures.push(format!("{what}: {} outputs, {ended} ended", out.len()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    // Nothing leaked: a good request runs to one terminal event, no KV held.
    let (status, _) = add(s, &base);
    ok(status);
    assert_eq!(run_to_completion(s).len(), 1);
    // SAFETY: all-zero is a valid stats struct.
    let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
    st.struct_size = size_of::<ni_session_stats>() as u32;
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_get_stats(s, &mut st) });
    assert_eq!(st.kv_used_tokens, 0);
    // SAFETY: created above, freed once.
    unsafe { ni_session_free(s) };
}
