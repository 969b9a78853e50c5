//! Concurrency through the C ABI, as the header allows it: several host
//! threads each driving their own session over one shared model (and so
//! one shared kernel thread pool), and other threads adding, cancelling
//! and reading stats while a session's owner thread steps. Outputs must
//! equal sequential runs, every request must end with exactly one terminal
//! event, and a request ends cancelled exactly when its cancel succeeded.
//! `scripts/tsan.sh` runs these under ThreadSanitizer.

mod engine_common;
mod ffi_common;

use engine_common::{random_prompts, write_tiny_llama, TempDir, TestRng, TinySpec};
use ffi_common::{add_tokens, collect, load_model_at, ok, run_to_completion, stats, Collected};
use nanoinfer::ffi::*;
use std::collections::BTreeMap;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Clears a flag when dropped, also while unwinding from a failed
/// assertion, so that the threads waiting on it end and the scope can join.
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

struct Handle<T>(*mut T);

impl<T> Clone for Handle<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Handle<T> {}
// SAFETY: models may be used from any thread, and sessions accept
// add/cancel/stats from any thread (documented in the header); each test
// steps a session from one thread only.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

/// A tiny random Llama loaded through `ni_model_load` with 2 kernel threads.
fn load_tiny(dir: &TempDir) -> *mut ni_model {
    write_tiny_llama(dir.path(), &TinySpec::default());
    load_model_at(dir.path())
}

fn new_session(model: *mut ni_model, kv_capacity: u64, max_seqs: u32) -> *mut ni_session {
    let mut p = ffi_common::session_params();
    p.kv_capacity_tokens = kv_capacity;
    p.max_seqs = max_seqs;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &p, &mut s) });
    s
}

/// Each (prompt, max_tokens) run alone in a fresh session: the reference.
fn solo(model: *mut ni_model, reqs: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|(p, n)| {
            let s = new_session(model, 4096, 4);
            let id = add_tokens(s, p, *n);
            let r = run_to_completion(s);
            // SAFETY: created above, freed once.
            unsafe { ni_session_free(s) };
            assert_eq!(r[&id].finish, NI_FINISH_LENGTH);
            r[&id].tokens.clone()
        })
        .collect()
}

#[test]
fn threads_with_their_own_sessions_share_one_model() {
    let dir = TempDir::new("conc-shared");
    let model = load_tiny(&dir);
    let reqs: Vec<(Vec<u32>, u32)> = random_prompts(21, 8, 3, 60, 128)
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, 4 + 2 * i as u32))
        .collect();
    let want = solo(model, &reqs);
    let m = Handle(model);
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (reqs, want) = (&reqs, &want);
            scope.spawn(move || {
                let m = m;
                for round in 0..3 {
                    // Small caches on some threads: preemption under load too.
                    let cap = if (t + round) % 2 == 0 { 4096 } else { 140 };
                    let s = new_session(m.0, cap, 3);
                    let picks: Vec<usize> =
                        (0..5).map(|k| (t + round + 3 * k) % reqs.len()).collect();
                    let ids: Vec<u64> = picks
                        .iter()
                        .map(|&i| add_tokens(s, &reqs[i].0, reqs[i].1))
                        .collect();
                    let got = run_to_completion(s);
                    for (id, &i) in ids.iter().zip(&picks) {
                        assert_eq!(got[id].finish, NI_FINISH_LENGTH, "thread {t}");
                        assert_eq!(
                            got[id].tokens, want[i],
                            "thread {t} round {round} request {i}"
                        );
                    }
                    let st = stats(s);
                    assert_eq!(st.kv_used_tokens, 0);
                    // SAFETY: created above, freed once, by this thread only.
                    unsafe { ni_session_free(s) };
                }
            });
        }
    });
    // SAFETY: every session is freed; freed once.
    unsafe { ni_model_free(model) };
}

/// One owner thread steps; an adder, a canceller and a stats reader run at
/// the same time, as the header allows.
#[test]
fn add_cancel_and_stats_race_with_stepping() {
    let dir = TempDir::new("conc-race");
    let model = load_tiny(&dir);
    for seed in 0..3u64 {
        let session = new_session(model, 200, 4);
        let capacity = stats(session).kv_capacity_tokens;
        let added: Mutex<Vec<(u64, Vec<u32>, u32)>> = Mutex::new(vec![]);
        let cancelled: Mutex<Vec<u64>> = Mutex::new(vec![]);
        let adding = AtomicBool::new(true);
        let stepping = AtomicBool::new(true);
        let s = Handle(session);
        let (added_r, cancelled_r) = (&added, &cancelled);
        let (adding, stepping) = (&adding, &stepping);
        let results = std::thread::scope(|scope| {
            // Adder.
            scope.spawn(move || {
                let s = s;
                let _done = ClearOnDrop(adding);
                let mut rng = TestRng::new(100 + seed);
                for _ in 0..24 {
                    let len = rng.range(2, 50);
                    let prompt = rng.tokens(len, 128);
                    let n = rng.range(1, 24) as u32;
                    let id = add_tokens(s.0, &prompt, n);
                    added_r.lock().unwrap().push((id, prompt, n));
                    std::thread::sleep(std::time::Duration::from_micros(rng.range(0, 3000) as u64));
                }
            });
            // Canceller: random known ids, some already finished.
            scope.spawn(move || {
                let s = s;
                let mut rng = TestRng::new(200 + seed);
                while stepping.load(Ordering::Acquire) {
                    let id = {
                        let a = added_r.lock().unwrap();
                        if a.is_empty() || !rng.chance(0.3) {
                            None
                        } else {
                            Some(a[rng.range(0, a.len())].0)
                        }
                    };
                    if let Some(id) = id {
                        // SAFETY: a live session handle.
                        let st = unsafe { ni_session_cancel(s.0, id) };
                        match st {
                            NI_OK => cancelled_r.lock().unwrap().push(id),
                            NI_ERR_INVALID_ARGUMENT => {}
                            other => panic!("cancel of {id} returned {other}"),
                        }
                    }
                    std::thread::sleep(std::time::Duration::from_micros(rng.range(0, 2000) as u64));
                }
            });
            // Stats reader.
            scope.spawn(move || {
                let s = s;
                let mut reads = 0u64;
                while stepping.load(Ordering::Acquire) {
                    let st = stats(s.0);
                    assert!(st.kv_used_tokens <= st.kv_capacity_tokens, "{st:?}");
                    assert!(st.running <= 4);
                    reads += 1;
                    std::thread::yield_now();
                }
                assert!(reads > 0);
            });
            // Owner: steps until everything is added and done.
            let owner = scope.spawn(move || {
                let s = s;
                let _done = ClearOnDrop(stepping);
                let mut out = ptr::null_mut();
                let mut results = BTreeMap::<u64, Collected>::new();
                // SAFETY: live handles; the output is used by this thread only.
                unsafe {
                    ok(ni_step_output_create(&mut out));
                    loop {
                        let more = adding.load(Ordering::Acquire);
                        if ni_session_has_work(s.0) {
                            ok(ni_session_step(s.0, out));
                            collect(out, &mut results);
                        } else if !more {
                            break;
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    ni_step_output_free(out);
                }
                results
            });
            owner.join().unwrap()
        });
        let added = added.into_inner().unwrap();
        let cancelled = cancelled.into_inner().unwrap();
        let reqs: Vec<(Vec<u32>, u32)> = added.iter().map(|(_, p, n)| (p.clone(), *n)).collect();
        let want = solo(model, &reqs);
        let mut n_cancelled = 0;
        for ((id, _, n), want) in added.iter().zip(&want) {
            let c = &results[id];
            if cancelled.contains(id) {
                assert_eq!(c.finish, NI_FINISH_CANCELLED, "seed {seed}: request {id}");
                assert!(want.starts_with(&c.tokens), "seed {seed}: request {id}");
                n_cancelled += 1;
            } else {
                assert_eq!(c.finish, NI_FINISH_LENGTH, "seed {seed}: request {id}");
                assert_eq!(c.tokens.len(), *n as usize);
                assert_eq!(&c.tokens, want, "seed {seed}: request {id}");
            }
        }
        assert_eq!(
            cancelled.len(),
            n_cancelled,
            "seed {seed}: one cancel succeeded twice"
        );
        let st = stats(session);
        assert_eq!((st.running, st.waiting, st.kv_used_tokens), (0, 0, 0));
        assert_eq!(st.kv_free_tokens + st.kv_cached_tokens, capacity);
        eprintln!(
            "seed {seed}: {} requests, {n_cancelled} cancelled while the owner stepped",
            added.len()
        );
        // SAFETY: all threads are joined; freed once.
        unsafe { ni_session_free(session) };
    }
    // SAFETY: freed once, after its sessions.
    unsafe { ni_model_free(model) };
}
