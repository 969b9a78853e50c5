//! Randomized soak: thousands of add / step / cancel operations with random
//! lengths, priorities, shared prefixes and cancellations against a small
//! cache, under random session settings. After every operation the session's
//! invariants hold; every accepted request gets exactly one terminal event;
//! every request that ran to its end produced what it produces alone.
//!
//! `soak_timed_through_the_c_abi` (ignored: `scripts/soak.sh MINUTES` runs it)
//! does the same through the exported C functions for a fixed time, with a
//! second thread reading stats concurrently, and samples the process RSS
//! every second: memory must stay flat once warm.

mod engine_common;
mod ffi_common;

use engine_common::*;
use nanoinfer::engine::{
    FinishReason, Model, PreemptionMode, RequestId, RequestParams, SchedulePolicyKind, Session,
    SessionParams, SpeculativeMethod, SpeculativeParams,
};
use nanoinfer::kv::KvBackendKind;
use nanoinfer::sampling::SamplingParams;
use std::sync::Arc;

fn random_params(rng: &mut TestRng, capacity: usize, model: &Arc<Model>) -> SessionParams {
    let k = rng.range(1, 6);
    let speculative = match rng.range(0, 3) {
        0 => None,
        1 => Some(SpeculativeParams {
            method: SpeculativeMethod::Ngram {
                min_n: rng.range(1, 3),
                max_n: rng.range(3, 5),
            },
            num_speculative_tokens: k,
            max_batch: rng.range(1, 12),
        }),
        // The model drafting for itself: its drafts are mostly kept.
        _ => Some(SpeculativeParams {
            max_batch: rng.range(1, 12),
            ..SpeculativeParams::draft(model.clone(), k)
        }),
    };
    SessionParams {
        speculative,
        kv_backend: if rng.chance(0.5) {
            KvBackendKind::Paged
        } else {
            KvBackendKind::Token
        },
        block_size: [1, 2, 4, 16][rng.range(0, 4)],
        kv_capacity_tokens: capacity,
        max_batched_tokens: rng.range(8, 128),
        max_seqs: rng.range(1, 12),
        prefill_chunk_size: [1, 3, 7, 16, 64][rng.range(0, 5)],
        policy: if rng.chance(0.5) {
            SchedulePolicyKind::Fcfs
        } else {
            SchedulePolicyKind::Priority
        },
        aging_steps: rng.range(1, 20) as u64,
        prefix_caching: rng.chance(0.6),
        preemption: if rng.chance(0.5) {
            PreemptionMode::Recompute
        } else {
            PreemptionMode::Swap
        },
        ..Default::default()
    }
}

fn random_request(rng: &mut TestRng, prefixes: &[Vec<u32>], capacity: usize) -> RequestParams {
    let mut prompt = if rng.chance(0.4) {
        prefixes[rng.range(0, prefixes.len())].clone()
    } else {
        vec![]
    };
    let extra = rng.range(if prompt.is_empty() { 1 } else { 0 }, 40);
    prompt.extend(rng.tokens(extra, 128));
    // Now and then a request too large for the cache, which must be refused.
    let max_tokens = if rng.chance(0.03) {
        capacity as u32
    } else {
        rng.range(1, 40) as u32
    };
    let sampling = if rng.chance(0.3) {
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            seed: Some(rng.next_u64()),
            max_tokens,
            ..Default::default()
        }
    } else {
        SamplingParams {
            max_tokens,
            ..Default::default()
        }
    };
    RequestParams {
        prompt,
        sampling,
        priority: rng.range(0, 4) as i32,
        cache_salt: rng.range(0, 2) as u64,
        constraint: None,
        retain_state: false,
        disable_speculation: rng.chance(0.3),
    }
}

fn soak(seed: u64, ops: usize) {
    let m = default_tiny();
    let mut rng = TestRng::new(seed);
    let capacity = rng.range(100, 260);
    let params = random_params(&mut rng, capacity, &m);
    let cfg = format!("seed {seed}: {params:?}");
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let len = rng.range(10, 50);
            rng.tokens(len, 128)
        })
        .collect();
    let mut s = Session::new(m.model.clone(), params).unwrap();
    let mut log = EventLog::default();
    let mut accepted: Vec<(RequestId, RequestParams)> = Vec::new();
    let mut cancelled = 0;
    for _ in 0..ops {
        let roll = rng.range(0, 100);
        if roll < 30 {
            let r = random_request(&mut rng, &prefixes, capacity);
            let fits = r.prompt.len() + r.sampling.max_tokens as usize <= capacity;
            match s.add_request(r.clone()) {
                Ok(id) => {
                    assert!(fits, "{cfg}: oversized request accepted");
                    log.expect(id);
                    accepted.push((id, r));
                }
                Err(e) => {
                    assert!(!fits, "{cfg}: fitting request refused: {e}");
                    assert!(e.message.contains("KV capacity"), "{e}");
                }
            }
        } else if roll < 40 && !accepted.is_empty() {
            let (id, _) = accepted[rng.range(0, accepted.len())];
            let active = s.is_active(id);
            let res = s.cancel(id);
            assert_eq!(res.is_ok(), active, "{cfg}: cancel of request {id}");
            cancelled += res.is_ok() as usize;
        } else {
            log.record(s.step().unwrap());
        }
        if let Err(e) = s.check_invariants() {
            panic!("{cfg}: invariant violated after {} steps: {e}", log.steps);
        }
    }
    drain(&mut s, &mut log, 100_000);

    let st = s.stats();
    let mut compared = 0;
    for (id, r) in &accepted {
        let o = log.get(*id);
        match o.finish.as_ref().unwrap() {
            FinishReason::Cancelled => {}
            FinishReason::Length => {
                assert_eq!(o.tokens.len(), r.sampling.max_tokens as usize);
                assert_eq!(
                    o.tokens,
                    run_alone(&m, r).tokens,
                    "{cfg}: request {id} differs from running alone"
                );
                compared += 1;
            }
            other => panic!("{cfg}: request {id} ended with {other:?}"),
        }
    }
    assert!(
        compared > accepted.len() / 3,
        "{cfg}: too few requests completed ({compared} of {})",
        accepted.len()
    );
    assert!(cancelled > 0, "{cfg}");
    eprintln!(
        "seed {seed}: {} requests, {compared} compared, {cancelled} cancelled, {} steps, {} preemptions, {} cached tokens",
        accepted.len(),
        log.steps,
        st.preemptions,
        st.prefix_cached_tokens
    );
}

#[test]
fn soak_random_sessions() {
    for seed in 0..8 {
        soak(1000 + seed, 2500);
    }
}

/// Resident set size of this process, from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the soak asked for and what came back, per request.
struct Tracked {
    params: RequestParams,
    cancel_sent: bool,
}

/// Random session params through `ni_session_params`.
fn random_c_params(rng: &mut TestRng) -> nanoinfer::ffi::ni_session_params {
    use nanoinfer::ffi::*;
    let mut p = ffi_common::session_params();
    p.kv_backend = if rng.chance(0.5) {
        NI_KV_BACKEND_PAGED
    } else {
        NI_KV_BACKEND_TOKEN
    };
    p.block_size = [1, 2, 4, 16][rng.range(0, 4)];
    p.kv_capacity_tokens = rng.range(64, 300) as u64;
    p.max_batched_tokens = rng.range(8, 128) as u32;
    p.max_seqs = rng.range(1, 12) as u32;
    p.prefill_chunk_size = [1, 3, 7, 16, 64][rng.range(0, 5)];
    p.policy = if rng.chance(0.5) {
        NI_SCHEDULE_FCFS
    } else {
        NI_SCHEDULE_PRIORITY
    };
    p.aging_steps = rng.range(1, 20) as u64;
    p.prefix_caching = rng.chance(0.6);
    p.preemption = if rng.chance(0.5) {
        NI_PREEMPTION_RECOMPUTE
    } else {
        NI_PREEMPTION_SWAP
    };
    p
}

/// Sets a helper thread's stop flag when dropped, also while unwinding from a
/// failed assertion: the scope joins the helper, so without it a failure
/// would hang instead of failing.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

struct SessionPtr(*mut nanoinfer::ffi::ni_session);
// SAFETY: stats may be read from any thread (documented in the header).
unsafe impl Send for SessionPtr {}
unsafe impl Sync for SessionPtr {}

/// One session's life: random add / cancel / step / stats operations, then
/// drain; checks every invariant the C ABI exposes. Returns (requests,
/// cancelled, compared with a solo run, tokens generated).
fn soak_c_round(
    rng: &mut TestRng,
    model: *mut nanoinfer::ffi::ni_model,
    reference: &std::sync::Arc<nanoinfer::engine::Model>,
    eos: u32,
) -> (usize, usize, usize, usize) {
    use ffi_common::{collect, ok, stats, Collected};
    use nanoinfer::ffi::*;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};

    let params = random_c_params(rng);
    let capacity = params.kv_capacity_tokens as usize;
    let cfg = format!("{params:?}");
    let mut session = std::ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(model, &params, &mut session) });
    let mut out = std::ptr::null_mut();
    // SAFETY: valid pointer.
    ok(unsafe { ni_step_output_create(&mut out) });
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let len = rng.range(10, 50);
            rng.tokens(len, 128)
        })
        .collect();
    let mut tracked: BTreeMap<u64, Tracked> = BTreeMap::new();
    let mut results: BTreeMap<u64, Collected> = BTreeMap::new();
    let ops = rng.range(200, 1500);
    let stop = AtomicBool::new(false);
    let shared = SessionPtr(session);
    std::thread::scope(|scope| {
        // A host thread polling stats while the owner steps (allowed by the header).
        scope.spawn(|| {
            let shared = &shared;
            while !stop.load(Ordering::Relaxed) {
                let st = stats(shared.0);
                assert!(
                    st.kv_used_tokens + st.kv_free_tokens + st.kv_cached_tokens
                        <= st.kv_capacity_tokens + st.kv_block_size
                );
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
        let _stop = StopOnDrop(&stop);
        for _ in 0..ops {
            let roll = rng.range(0, 100);
            if roll < 30 {
                let r = random_request(rng, &prefixes, capacity);
                let fits = r.prompt.len() + r.sampling.max_tokens as usize <= capacity;
                let mut c = ffi_common::request_params();
                c.prompt_tokens = r.prompt.as_ptr();
                c.n_prompt_tokens = r.prompt.len();
                c.max_tokens = r.sampling.max_tokens;
                c.temperature = r.sampling.temperature;
                c.top_k = r.sampling.top_k;
                if let Some(seed) = r.sampling.seed {
                    c.seed = seed;
                    c.use_seed = true;
                }
                c.priority = r.priority;
                c.cache_salt = r.cache_salt;
                let mut id = 0;
                // SAFETY: valid pointers that outlive the call.
                let st = unsafe { ni_session_add_request(session, &c, &mut id) };
                if st == NI_OK {
                    assert!(fits, "{cfg}: oversized request accepted");
                    assert!(tracked
                        .insert(
                            id,
                            Tracked {
                                params: r,
                                cancel_sent: false
                            }
                        )
                        .is_none());
                } else {
                    assert!(
                        !fits,
                        "{cfg}: fitting request refused: {}",
                        ffi_common::last_error()
                    );
                    assert_eq!(st, NI_ERR_INVALID_ARGUMENT);
                }
            } else if roll < 40 && !tracked.is_empty() {
                let ids: Vec<u64> = tracked.keys().copied().collect();
                let id = ids[rng.range(0, ids.len())];
                let active = !tracked[&id].cancel_sent
                    && results.get(&id).is_none_or(|c| c.finish == NI_FINISH_NONE);
                // SAFETY: valid handle.
                let st = unsafe { ni_session_cancel(session, id) };
                assert_eq!(st == NI_OK, active, "{cfg}: cancel of request {id}");
                if st == NI_OK {
                    tracked.get_mut(&id).unwrap().cancel_sent = true;
                }
            } else {
                // SAFETY: valid handles; events are read before the next step.
                unsafe {
                    ok(ni_session_step(session, out));
                    collect(out, &mut results);
                }
            }
            let st = stats(session);
            assert!(st.kv_used_tokens <= st.kv_capacity_tokens, "{cfg}: {st:?}");
        }
        // SAFETY: valid handles.
        unsafe {
            let mut steps = 0;
            while ni_session_has_work(session) {
                steps += 1;
                assert!(steps < 100_000, "{cfg}: never became idle");
                ok(ni_session_step(session, out));
                collect(out, &mut results);
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let st = stats(session);
    assert_eq!(
        (st.running, st.waiting, st.kv_used_tokens),
        (0, 0, 0),
        "{cfg}: not clean at idle: {st:?}"
    );
    assert_eq!(
        st.kv_free_tokens + st.kv_cached_tokens,
        st.kv_capacity_tokens,
        "{cfg}: KV leaked: {st:?}"
    );

    let (mut cancelled, mut compared, mut tokens) = (0, 0, 0);
    for (id, t) in &tracked {
        let c = results
            .get(id)
            .unwrap_or_else(|| panic!("{cfg}: request {id} lost"));
        tokens += c.tokens.len();
        let greedy = t.params.sampling.temperature == 0.0;
        match c.finish {
            NI_FINISH_CANCELLED => {
                assert!(t.cancel_sent, "{cfg}: {id} cancelled by nobody");
                cancelled += 1;
            }
            NI_FINISH_LENGTH => {
                assert_eq!(
                    c.tokens.len(),
                    t.params.sampling.max_tokens as usize,
                    "{cfg}"
                );
                if greedy && compared < 4 {
                    assert_eq!(
                        c.tokens,
                        run_alone(reference, &t.params).tokens,
                        "{cfg}: request {id} differs from running alone"
                    );
                    compared += 1;
                }
            }
            NI_FINISH_EOS => assert_eq!(c.tokens.last(), Some(&eos), "{cfg}"),
            other => panic!("{cfg}: request {id} ended with {other} ({:?})", c.error),
        }
    }
    // SAFETY: created above, freed once.
    unsafe {
        ni_step_output_free(out);
        ni_session_free(session);
    }
    (tracked.len(), cancelled, compared, tokens)
}

#[test]
#[ignore = "long: run by scripts/soak.sh"]
fn soak_timed_through_the_c_abi() {
    use nanoinfer::ffi::*;
    let secs = env_u64("NANOINFER_SOAK_SECS", 60);
    let seed = env_u64("NANOINFER_SOAK_SEED", 1);
    let eos = 3;
    let spec = TinySpec {
        vocab: 256,
        eos: Some(eos),
        ..Default::default()
    };
    let dir = engine_common::TempDir::new("soak-c");
    write_tiny_llama(dir.path(), &spec);
    let reference = {
        let params = nanoinfer::engine::ModelParams {
            threads: 1,
            ..Default::default()
        };
        std::sync::Arc::new(nanoinfer::engine::Model::load(dir.path(), &params, None).unwrap())
    };
    let path = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: valid pointers; NULL params = defaults.
    ffi_common::ok(unsafe { ni_model_load(path.as_ptr(), std::ptr::null(), &mut model) });

    let mut rng = TestRng::new(seed);
    let start = std::time::Instant::now();
    let deadline = std::time::Duration::from_secs(secs);
    let (mut rounds, mut requests, mut cancelled, mut compared, mut tokens) = (0, 0, 0, 0, 0);
    let done = std::sync::atomic::AtomicBool::new(false);
    // RSS once a second, from a sampler thread, while the rounds run.
    let samples = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut samples = vec![];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                samples.push((start.elapsed().as_secs_f64(), rss_bytes()));
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            samples
        });
        let stop_sampler = StopOnDrop(&done);
        while start.elapsed() < deadline {
            let (r, c, k, t) = soak_c_round(&mut rng, model, &reference, eos);
            rounds += 1;
            requests += r;
            cancelled += c;
            compared += k;
            tokens += t;
        }
        drop(stop_sampler);
        sampler.join().unwrap()
    });
    // SAFETY: loaded above, freed once.
    unsafe { ni_model_free(model) };
    let final_rss = rss_bytes();
    // Warm: the first sample after a tenth of the run (caches, pools and
    // allocator arenas have reached their working size by then).
    let warm = samples
        .iter()
        .find(|(t, _)| *t >= secs as f64 / 10.0)
        .unwrap_or(&samples[samples.len() - 1])
        .1;
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let drift = final_rss as i64 - warm as i64;
    eprintln!(
        "soak (C ABI, seed {seed}): {:.0} s, {rounds} sessions, {requests} requests ({cancelled} cancelled, \
         {compared} compared with a solo run), {tokens} tokens generated; RSS warm {:.1} MiB, peak {:.1} MiB, \
         final {:.1} MiB, drift {:+.2} MiB; {} samples",
        start.elapsed().as_secs_f64(),
        mib(warm),
        mib(peak),
        mib(final_rss),
        drift as f64 / (1 << 20) as f64,
        samples.len()
    );
    if let Ok(path) = std::env::var("NANOINFER_SOAK_RSS_CSV") {
        let csv: String = samples
            .iter()
            .map(|(t, r)| format!("{t:.1},{r}\n"))
            .collect();
        std::fs::write(path, format!("seconds,rss_bytes\n{csv}")).unwrap();
    }
    assert!(rounds > 0 && requests > 0 && cancelled > 0 && compared > 0);
    // Flat memory once warm: allow allocator noise, not growth. Under a
    // sanitizer (quarantined frees) set NANOINFER_SOAK_RSS_CHECK=0.
    let allowed = (8 << 20).max(warm / 10) as i64;
    if env_u64("NANOINFER_SOAK_RSS_CHECK", 1) != 0 {
        assert!(
            drift <= allowed,
            "RSS grew by {drift} bytes (allowed {allowed})"
        );
    }
}
