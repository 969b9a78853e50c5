//! Cancellation and the abort callback inside a running step, through the
//! C ABI: `ni_session_cancel` never waits for a step, a step holding the
//! cancelled request stops within a layer, an aborted step redoes its work
//! exactly, and the other requests of an interrupted step are unaffected.

mod engine_common;
mod ffi_common;

use engine_common::{write_tiny_llama, TempDir, TinySpec};
use ffi_common::{add_tokens, collect, load_model_at, ok, run_to_completion, stats, Collected};
use nanoinfer::ffi::*;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Handle<T>(*mut T);
// SAFETY: sessions accept ni_session_cancel from any thread (documented);
// each session is stepped by one thread at a time.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

fn session_with(
    model: *mut ni_model,
    kv_capacity: u64,
    max_batched_tokens: u32,
) -> *mut ni_session {
    let mut p = ffi_common::session_params();
    p.kv_capacity_tokens = kv_capacity;
    p.max_batched_tokens = max_batched_tokens;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &p, &mut s) });
    s
}

/// `n` token ids spread over the vocabulary (no repetition for the prefix
/// cache to exploit).
fn prompt(n: usize, vocab: u32, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(salt * 104_729)) % (vocab - 1) + 1)
        .collect()
}

fn vocab_of(model: *mut ni_model) -> (u32, u32) {
    // SAFETY: all-zero is a valid ni_model_info; valid pointers.
    let mut info: ni_model_info = unsafe { std::mem::zeroed() };
    info.struct_size = size_of::<ni_model_info>() as u32;
    ok(unsafe { ni_model_get_info(model, &mut info) });
    (info.vocab_size, info.n_layers)
}

/// An abort callback driven by a test: counts its polls, cancels a request
/// at a chosen poll (from inside the callback, which the header allows),
/// and returns true from a chosen poll on.
#[derive(Default)]
struct Probe {
    polls: AtomicUsize,
    abort_from_poll: AtomicUsize,
    cancel_at_poll: AtomicUsize,
    cancel_id: AtomicU64,
    session: std::sync::atomic::AtomicPtr<ni_session>,
    cancel_status: std::sync::atomic::AtomicI32,
    busy_status: std::sync::atomic::AtomicI32,
}

unsafe extern "C" fn probe_callback(user_data: *mut c_void) -> bool {
    // SAFETY: the tests pass a `Probe` that outlives the session's steps.
    let p = unsafe { &*user_data.cast::<Probe>() };
    let poll = p.polls.fetch_add(1, Ordering::SeqCst) + 1;
    let session = p.session.load(Ordering::SeqCst);
    if poll == p.cancel_at_poll.load(Ordering::SeqCst) {
        // SAFETY: a live session; cancel is allowed from the callback.
        let st = unsafe { ni_session_cancel(session, p.cancel_id.load(Ordering::SeqCst)) };
        p.cancel_status.store(st, Ordering::SeqCst);
        // Any other call on the session would wait for this very step.
        let mut stats: ni_session_stats = unsafe { std::mem::zeroed() };
        stats.struct_size = size_of::<ni_session_stats>() as u32;
        // SAFETY: valid pointers.
        let busy = unsafe { ni_session_get_stats(session, &mut stats) };
        p.busy_status.store(busy, Ordering::SeqCst);
    }
    let from = p.abort_from_poll.load(Ordering::SeqCst);
    from != 0 && poll >= from
}

fn install(session: *mut ni_session, probe: &Probe) {
    probe.session.store(session, Ordering::SeqCst);
    // SAFETY: the probe outlives every step of the session (each test
    // clears the callback or frees the session before dropping it).
    ok(unsafe {
        ni_session_set_abort_callback(
            session,
            Some(probe_callback),
            ptr::from_ref(probe).cast_mut().cast(),
        )
    });
}

fn tiny_model(dir: &TempDir, layers: usize) -> *mut ni_model {
    let spec = TinySpec {
        layers,
        max_positions: 1024,
        ..TinySpec::default()
    };
    write_tiny_llama(dir.path(), &spec);
    load_model_at(dir.path())
}

/// A step stopped by the abort callback fails with NI_ERR_CANCELLED and
/// advances nobody; stepping on gives exactly the uninterrupted output.
#[test]
fn an_aborted_step_is_redone_exactly() {
    let dir = TempDir::new("abort-redo");
    let model = tiny_model(&dir, 3);
    let (vocab, _) = vocab_of(model);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| prompt(150 + 40 * i, vocab, i as u32))
        .collect();
    let reference = {
        let s = session_with(model, 2048, 64);
        let ids: Vec<u64> = prompts.iter().map(|p| add_tokens(s, p, 12)).collect();
        let r = run_to_completion(s);
        // SAFETY: freed once.
        unsafe { ni_session_free(s) };
        ids.iter()
            .map(|id| r[id].tokens.clone())
            .collect::<Vec<_>>()
    };
    assert!(reference.iter().all(|t| t.len() == 12));

    // Abort every step at a different poll: in the first layer, mid-layer,
    // in the last layer; then let the redone step run through.
    for abort_at in [1, 2, 5, 9] {
        let s = session_with(model, 2048, 64);
        let probe = Probe::default();
        install(s, &probe);
        let ids: Vec<u64> = prompts.iter().map(|p| add_tokens(s, p, 12)).collect();
        let mut results = BTreeMap::<u64, Collected>::new();
        let mut out = ptr::null_mut();
        let (mut aborted, mut steps) = (0, 0);
        // SAFETY: valid handles; events read before the next step.
        unsafe {
            ok(ni_step_output_create(&mut out));
            while ni_session_has_work(s) {
                steps += 1;
                assert!(steps < 1000);
                // Odd attempts abort at `abort_at`, even ones run through.
                let abort = steps % 2 == 1;
                probe.polls.store(0, Ordering::SeqCst);
                probe
                    .abort_from_poll
                    .store(if abort { abort_at } else { 0 }, Ordering::SeqCst);
                let before = stats(s);
                let status = ni_session_step(s, out);
                if abort {
                    assert_eq!(status, NI_ERR_CANCELLED, "step {steps}");
                    assert!(ffi_common::last_error().contains("abort callback"));
                    let after = stats(s);
                    assert_eq!(
                        (after.prefill_tokens, after.decode_tokens),
                        (before.prefill_tokens, before.decode_tokens),
                        "an aborted step advanced nobody"
                    );
                    aborted += 1;
                    continue;
                }
                ok(status);
                collect(out, &mut results);
            }
            ni_step_output_free(out);
        }
        assert!(
            aborted >= 12,
            "abort at poll {abort_at}: {aborted} steps aborted"
        );
        for (id, want) in ids.iter().zip(&reference) {
            assert_eq!(results[id].finish, NI_FINISH_LENGTH);
            assert_eq!(&results[id].tokens, want, "abort at poll {abort_at}");
        }
        let st = stats(s);
        assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
        // SAFETY: freed once; the probe outlives it.
        unsafe { ni_session_free(s) };
    }
    // SAFETY: freed once, after its sessions.
    unsafe { ni_model_free(model) };
}

/// A cancel that arrives while its request's step runs stops that step;
/// the other requests of the step are computed again and give exactly
/// their uninterrupted output, and only the request's KV is freed.
#[test]
fn a_cancel_inside_a_step_leaves_the_other_requests_exact() {
    let dir = TempDir::new("cancel-inside");
    let model = tiny_model(&dir, 3);
    let (vocab, _) = vocab_of(model);
    let long = prompt(600, vocab, 1);
    let others: Vec<Vec<u32>> = (2..4).map(|i| prompt(90, vocab, i)).collect();
    let reference: Vec<Vec<u32>> = {
        let s = session_with(model, 2048, 256);
        let ids: Vec<u64> = others.iter().map(|p| add_tokens(s, p, 10)).collect();
        let r = run_to_completion(s);
        // SAFETY: freed once.
        unsafe { ni_session_free(s) };
        ids.iter().map(|id| r[id].tokens.clone()).collect()
    };
    for cancel_at in [1, 4, 8] {
        let s = session_with(model, 2048, 256);
        let probe = Probe::default();
        install(s, &probe);
        let other_ids: Vec<u64> = others.iter().map(|p| add_tokens(s, p, 10)).collect();
        let victim = add_tokens(s, &long, 10);
        probe.cancel_id.store(victim, Ordering::SeqCst);
        // The first step holds every request; the cancel comes from its
        // callback at poll `cancel_at`.
        probe.cancel_at_poll.store(cancel_at, Ordering::SeqCst);
        let results = run_to_completion(s);
        assert_eq!(probe.cancel_status.load(Ordering::SeqCst), NI_OK);
        assert_eq!(probe.busy_status.load(Ordering::SeqCst), NI_ERR_BUSY);
        // The flag is polled before the callback, so the step stopped at
        // the check after the cancel: a few polls, not the whole step.
        assert_eq!(results[&victim].finish, NI_FINISH_CANCELLED);
        assert!(results[&victim].tokens.is_empty());
        for (id, want) in other_ids.iter().zip(&reference) {
            assert_eq!(&results[id].tokens, want, "cancel at poll {cancel_at}");
        }
        let st = stats(s);
        assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
        assert_eq!(
            st.prefill_tokens as usize,
            others.iter().map(Vec::len).sum::<usize>(),
            "the interrupted step's work was dropped, not counted"
        );
        // SAFETY: freed once; the probe outlives it.
        unsafe { ni_session_free(s) };
    }
    // SAFETY: freed once, after its sessions.
    unsafe { ni_model_free(model) };
}

/// Without a running step, a cancel frees the request's KV before it
/// returns; from inside a step it is applied by that step.
#[test]
fn a_cancel_between_steps_frees_kv_at_once() {
    let dir = TempDir::new("cancel-between");
    let model = tiny_model(&dir, 2);
    let (vocab, _) = vocab_of(model);
    let s = session_with(model, 2048, 64);
    let id = add_tokens(s, &prompt(100, vocab, 5), 50);
    let mut out = ptr::null_mut();
    // SAFETY: valid handles.
    unsafe {
        ok(ni_step_output_create(&mut out));
        ok(ni_session_step(s, out));
        assert!(stats(s).kv_used_tokens > 0);
        ok(ni_session_cancel(s, id));
        assert_eq!(stats(s).kv_used_tokens, 0);
        assert_eq!(ni_session_cancel(s, id), NI_ERR_INVALID_ARGUMENT);
        let mut r = BTreeMap::new();
        ok(ni_session_step(s, out));
        collect(out, &mut r);
        assert_eq!(r[&id].finish, NI_FINISH_CANCELLED);
        assert!(!ni_session_has_work(s));
        ni_step_output_free(out);
        ni_session_free(s);
        ni_model_free(model);
    }
}

/// The real model, a 4k-token prompt, and a thread stepping in a tight
/// loop: a cancel returns at once and the step holding the request ends
/// within one layer's time. The bound is relative to the layer time
/// measured in the same run, so it holds on any CPU; the absolute figures
/// are printed (TESTING.md records them).
#[test]
fn a_cancel_stops_a_long_prefill_within_a_layer() {
    let model = ffi_common::shared_model();
    let (vocab, layers) = vocab_of(model);
    let s = session_with(model, 8192, 512);
    let long = prompt(4096, vocab, 9);
    let id = add_tokens(s, &long, 8);
    let chunks = long.len().div_ceil(512);

    let handle = Handle(s);
    let started_steps = AtomicUsize::new(0);
    let last_step_ns = AtomicU64::new(0);
    let stepping = AtomicBool::new(true);
    let (step_times, ended_at, finish) = std::thread::scope(|scope| {
        let (started, stepping, last) = (&started_steps, &stepping, &last_step_ns);
        let stepper = scope.spawn(move || {
            let s = handle;
            let mut out = ptr::null_mut();
            let mut times = Vec::new();
            let mut results = BTreeMap::<u64, Collected>::new();
            // SAFETY: this thread alone steps the session.
            unsafe {
                ok(ni_step_output_create(&mut out));
                while ni_session_has_work(s.0) {
                    started.fetch_add(1, Ordering::SeqCst);
                    let t = Instant::now();
                    ok(ni_session_step(s.0, out));
                    times.push(t.elapsed());
                    last.store(t.elapsed().as_nanos() as u64, Ordering::SeqCst);
                    collect(out, &mut results);
                    if results.get(&id).is_some_and(|c| c.finish != NI_FINISH_NONE) {
                        break;
                    }
                }
                let ended = Instant::now();
                ni_step_output_free(out);
                stepping.store(false, Ordering::SeqCst);
                (times, ended, results[&id].finish)
            }
        });
        // Let all but the last prefill chunk finish, so the step that is
        // cancelled runs over the longest context; cancel a third into it.
        while started_steps.load(Ordering::SeqCst) < chunks && stepping.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_nanos(
            last_step_ns.load(Ordering::SeqCst) / 3,
        ));
        let t = Instant::now();
        // SAFETY: a live session; cancel may come from any thread.
        ok(unsafe { ni_session_cancel(s, id) });
        let returned = t.elapsed();
        let (times, ended, finish) = stepper.join().unwrap();
        (times, (t, returned, ended), finish)
    });
    let (cancelled_at, cancel_returned, ended) = ended_at;
    assert_eq!(finish, NI_FINISH_CANCELLED);
    assert_eq!(
        step_times.len(),
        chunks,
        "the cancel landed in the last prefill step"
    );
    let latency = ended - cancelled_at;
    // The last full step: the one before the cancelled one, over nearly
    // the same context.
    let full_step = step_times[chunks - 2];
    let layer = full_step / layers;
    eprintln!(
        "cancel: returned in {:?}; the step ended {:.1} ms after it (one layer = {:.1} ms, \
         a full 512-token step at ~3.5k context = {:.0} ms, {layers} layers)",
        cancel_returned,
        latency.as_secs_f64() * 1e3,
        layer.as_secs_f64() * 1e3,
        full_step.as_secs_f64() * 1e3,
    );
    assert!(
        cancel_returned < Duration::from_millis(20),
        "cancel waited: {cancel_returned:?}"
    );
    // The stop is polled three times a layer; a layer of slack covers the
    // OS scheduling the cancelling and stepping threads on a busy machine.
    assert!(
        latency < 2 * layer + Duration::from_millis(20),
        "the step ended {latency:?} after the cancel; one layer takes {layer:?}"
    );
    assert_eq!(stats(s).kv_used_tokens, 0);
    // SAFETY: freed once.
    unsafe { ni_session_free(s) };
}
