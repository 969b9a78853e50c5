//! Sessions that share one model share its kernel threads. Driven at once
//! from two host threads, they must finish no later than the same work
//! run one session after the other (before the model's forward turns they
//! took 2.5 times as long: both callers' threads fought for the same
//! cores inside every parallel op).

mod ffi_common;

use ffi_common::{add_tokens, create_session, run_to_completion, shared_model};
use nanoinfer::ffi::*;
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Handle(*mut ni_session);
// SAFETY: each session is stepped by one thread at a time (the header's rule).
unsafe impl Send for Handle {}

/// One session's work: a prompt of `prompt_len` tokens, then `decode` tokens.
fn work(session: Handle, salt: u32) -> Vec<u32> {
    let prompt: Vec<u32> = (0..384u32)
        .map(|i| (i * 31 + salt * 977) % 40_000 + 100)
        .collect();
    let id = add_tokens(session.0, &prompt, 48);
    run_to_completion(session.0)[&id].tokens.clone()
}

#[test]
fn two_sessions_on_one_model_are_not_slower_than_one_after_the_other() {
    let model = shared_model();
    let sessions = [Handle(create_session(model)), Handle(create_session(model))];
    // Warm both (thread scratch, arenas) so neither timing pays first-use costs.
    for (i, &s) in sessions.iter().enumerate() {
        work(s, 10 + i as u32);
    }
    let mut sequential = Duration::MAX;
    let mut concurrent = Duration::MAX;
    // Best of three rounds of each, interleaved, to damp noise from the machine.
    for _ in 0..3 {
        let t = Instant::now();
        let want: Vec<Vec<u32>> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| work(s, i as u32))
            .collect::<Vec<_>>();
        sequential = sequential.min(t.elapsed());

        let t = Instant::now();
        let got: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = sessions
                .iter()
                .enumerate()
                .map(|(i, &s)| scope.spawn(move || work(s, i as u32)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        concurrent = concurrent.min(t.elapsed());
        assert_eq!(got, want, "concurrent sessions computed different tokens");
    }
    eprintln!(
        "two sessions on one model: one after the other {:.0} ms, at once {:.0} ms ({:.2}x)",
        sequential.as_secs_f64() * 1e3,
        concurrent.as_secs_f64() * 1e3,
        concurrent.as_secs_f64() / sequential.as_secs_f64()
    );
    // Taking turns costs a little (a 2-core EPYC: 0.94-1.06x quiet, 1.10x
    // beside another build); the fight this guards against cost 2.5x.
    assert!(
        concurrent.as_secs_f64() <= sequential.as_secs_f64() * 1.30,
        "at once {concurrent:?} vs one after the other {sequential:?}"
    );
    for s in sessions {
        // SAFETY: freed once; no thread uses them any more.
        unsafe { ni_session_free(s.0) };
    }
}
