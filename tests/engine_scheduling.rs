//! Scheduling order (FCFS, priority, aging) and cancellation at every point
//! of a request's life.

mod engine_common;

use engine_common::*;
use nanoinfer::engine::{
    FinishReason, RequestId, RequestParams, SchedulePolicyKind, Session, SessionParams,
};
use nanoinfer::kv::KvBackendKind;

fn with_priority(mut r: RequestParams, p: i32) -> RequestParams {
    r.priority = p;
    r
}

fn add(s: &mut Session, log: &mut EventLog, r: RequestParams) -> RequestId {
    let id = s.add_request(r).unwrap();
    log.expect(id);
    id
}

fn step(s: &mut Session, log: &mut EventLog) {
    log.record(s.step().unwrap());
    s.check_invariants().unwrap();
}

/// Under a full batch, a late high-priority arrival takes the first free
/// seat ahead of earlier low-priority waiters (and FCFS does the opposite).
#[test]
fn high_priority_arrival_is_scheduled_before_earlier_low_priority_waiters() {
    let m = default_tiny();
    let mut rng = TestRng::new(1);
    for policy in [SchedulePolicyKind::Priority, SchedulePolicyKind::Fcfs] {
        let params = SessionParams {
            max_seqs: 2,
            kv_capacity_tokens: 1024,
            policy,
            aging_steps: 1000,
            ..Default::default()
        };
        let mut s = Session::new(m.model.clone(), params).unwrap();
        let mut log = EventLog::default();
        let r1 = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(6, 128), 4), 5),
        );
        let _r2 = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(6, 128), 9), 5),
        );
        let l3 = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(6, 128), 6), 5),
        );
        let l4 = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(6, 128), 6), 5),
        );
        step(&mut s, &mut log);
        step(&mut s, &mut log);
        assert_eq!(
            (s.stats().running, s.stats().waiting),
            (2, 2),
            "batch full, two waiting"
        );
        let h = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(6, 128), 3), 0),
        );
        drain(&mut s, &mut log, 1000);
        let first = |id| log.get(id).first_token_step.unwrap();
        // r1 finishes first and frees the first seat.
        assert!(log.get(r1).finish_step.unwrap() < first(l3));
        match policy {
            SchedulePolicyKind::Priority => {
                assert!(
                    first(h) < first(l3) && first(h) < first(l4),
                    "priority: H must take the first free seat"
                );
                assert_eq!(first(h), log.get(r1).finish_step.unwrap() + 1);
            }
            SchedulePolicyKind::Fcfs => assert!(first(h) > first(l3), "fcfs: arrival order"),
        }
    }
}

/// A low-priority request under a never-ending stream of urgent arrivals
/// still finishes thanks to aging; without aging it starves.
#[test]
fn aging_lets_a_low_priority_request_finish_under_a_stream_of_urgent_ones() {
    let m = default_tiny();
    for (aging_steps, must_finish) in [(2u64, true), (1_000_000, false)] {
        let params = SessionParams {
            max_seqs: 1,
            kv_capacity_tokens: 1024,
            policy: SchedulePolicyKind::Priority,
            aging_steps,
            ..Default::default()
        };
        let mut s = Session::new(m.model.clone(), params).unwrap();
        let mut log = EventLog::default();
        let mut rng = TestRng::new(3);
        let head = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(4, 128), 3), 0),
        );
        let low = add(
            &mut s,
            &mut log,
            with_priority(request(rng.tokens(4, 128), 3), 10),
        );
        // One urgent request per step; each needs 2 steps, so the urgent
        // queue only grows.
        for _ in 0..200 {
            add(
                &mut s,
                &mut log,
                with_priority(request(rng.tokens(4, 128), 2), 0),
            );
            step(&mut s, &mut log);
        }
        assert!(log.get(head).finish.is_some());
        let finished = log.get(low).finish.is_some();
        assert_eq!(
            finished, must_finish,
            "aging_steps {aging_steps}: low-priority finished = {finished}"
        );
        if must_finish {
            // It waits for the urgent requests that arrived within
            // priority × aging_steps = 20 steps after it, not for the whole stream.
            assert!(
                log.get(low).finish_step.unwrap() < 80,
                "finished at {:?}",
                log.get(low).finish_step
            );
        }
        drain(&mut s, &mut log, 10_000);
        assert_eq!(log.get(low).tokens.len(), 3);
    }
}

/// Where to cancel the victim request.
#[derive(Debug, Clone, Copy)]
enum CancelPoint {
    Waiting,
    MidPrefill,
    Decoding,
    /// After max_tokens - 1 tokens: the next step would finish it.
    LastStep,
}

#[test]
fn cancel_at_every_point_gives_one_terminal_event_and_frees_kv() {
    let m = default_tiny();
    let mut rng = TestRng::new(12);
    let others: Vec<RequestParams> = (0..3).map(|_| request(rng.tokens(30, 128), 12)).collect();
    let expected: Vec<Vec<u32>> = others.iter().map(|r| run_alone(&m, r).tokens).collect();
    let victim_prompt = rng.tokens(60, 128);
    for kind in [KvBackendKind::Paged, KvBackendKind::Token] {
        for prefix in [false, true] {
            for point in [
                CancelPoint::Waiting,
                CancelPoint::MidPrefill,
                CancelPoint::Decoding,
                CancelPoint::LastStep,
            ] {
                let cfg = format!("{kind:?} prefix {prefix} {point:?}");
                let mut params = session_params(kind, 4, 512, 8, prefix);
                params.max_seqs = if matches!(point, CancelPoint::Waiting) {
                    3
                } else {
                    4
                };
                let mut s = Session::new(m.model.clone(), params).unwrap();
                let mut log = EventLog::default();
                let ids: Vec<RequestId> = others
                    .iter()
                    .map(|r| add(&mut s, &mut log, r.clone()))
                    .collect();
                let victim = add(&mut s, &mut log, request(victim_prompt.clone(), 6));
                match point {
                    CancelPoint::Waiting => step(&mut s, &mut log),
                    CancelPoint::MidPrefill => {
                        // Chunks of 8: after two steps 16 of 60 prompt tokens are computed.
                        step(&mut s, &mut log);
                        step(&mut s, &mut log);
                        assert!(log.get(victim).tokens.is_empty());
                    }
                    CancelPoint::Decoding | CancelPoint::LastStep => {
                        let want = if matches!(point, CancelPoint::Decoding) {
                            2
                        } else {
                            5
                        };
                        while log.get(victim).tokens.len() < want {
                            step(&mut s, &mut log);
                        }
                    }
                }
                let used_before = s.stats().kv.used_slots;
                let running_before = s.stats().running;
                s.cancel(victim).unwrap();
                let st = s.stats();
                if matches!(point, CancelPoint::Waiting) {
                    assert_eq!(running_before, 3, "{cfg}: victim should still be waiting");
                    assert_eq!(st.kv.used_slots, used_before, "{cfg}");
                } else {
                    assert!(
                        st.kv.used_slots < used_before,
                        "{cfg}: cancel did not free KV: {st:?}"
                    );
                }
                s.check_invariants().unwrap();
                assert!(s.cancel(victim).is_err(), "{cfg}: second cancel must fail");
                let generated = log.get(victim).tokens.len();
                drain(&mut s, &mut log, 1000);
                let v = log.get(victim);
                assert_eq!(v.finish, Some(FinishReason::Cancelled), "{cfg}");
                assert_eq!(v.tokens.len(), generated, "{cfg}: tokens after cancel");
                for (i, id) in ids.iter().enumerate() {
                    assert_eq!(
                        log.get(*id).tokens,
                        expected[i],
                        "{cfg}: other request {i} affected"
                    );
                }
                let e = s.cancel(ids[0]).unwrap_err();
                assert!(e.message.contains("not active"), "{e}");
            }
        }
    }
}

#[test]
fn cancel_unknown_request_is_an_error_and_changes_nothing() {
    let m = default_tiny();
    let mut s = Session::new(
        m.model.clone(),
        SessionParams {
            kv_capacity_tokens: 256,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(s.cancel(42).is_err());
    assert!(!s.has_work());
    let id = s.add_request(request(vec![1, 2, 3], 2)).unwrap();
    s.cancel(id).unwrap();
    assert!(s.has_work(), "the cancel event is still to be reported");
    let ev = s.step().unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].finish, Some(FinishReason::Cancelled));
    assert!(!s.has_work());
    assert_idle_clean(&s);
}

#[test]
fn automatic_step_shape_is_the_devices_and_explicit_values_stay() {
    let m = default_tiny();
    let shape = |p: &SessionParams| (p.max_batched_tokens, p.max_seqs, p.prefill_chunk_size);
    let open = |params: SessionParams| Session::new(m.model.clone(), params).unwrap();
    let kv = SessionParams {
        kv_capacity_tokens: 256,
        ..Default::default()
    };
    assert_eq!(
        shape(&SessionParams::default()),
        (0, 0, 0),
        "automatic by default"
    );
    assert_eq!(
        shape(open(kv.clone()).params()),
        (512, 64, 512),
        "the CPU's shape"
    );
    let budget_only = SessionParams {
        max_batched_tokens: 96,
        ..kv.clone()
    };
    assert_eq!(
        shape(open(budget_only).params()),
        (96, 64, 96),
        "chunks follow the budget"
    );
    let explicit = SessionParams {
        max_batched_tokens: 96,
        max_seqs: 3,
        prefill_chunk_size: 7,
        ..kv.clone()
    };
    assert_eq!(shape(open(explicit.clone()).params()), (96, 3, 7));
    // A GPU's shape, resolved without one.
    assert_eq!(shape(&kv.with_step_shape(true)), (8192, 256, 8192));
    assert_eq!(shape(&explicit.with_step_shape(true)), (96, 3, 7));
}
