//! The memory subsystem through the C ABI (issue 6): every memory pool is
//! selectable and gives the same greedy output, the budget report comes
//! through `ni_session_get_stats`, a utilization budget follows vLLM's rule,
//! and callers built against the older (smaller) params/stats structs still work.

mod ffi_common;

use ffi_common::*;
use nanoinfer::ffi::*;
use std::ptr;

fn stats_sized(session: *mut ni_session, size: usize) -> (ni_status, ni_session_stats) {
    // SAFETY: all-zero is a valid ni_session_stats (integers, a float, a bool).
    let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
    st.struct_size = size as u32;
    // SAFETY: valid pointers; `st` has room for the full struct.
    let status = unsafe { ni_session_get_stats(session, &mut st) };
    (status, st)
}

fn stats(session: *mut ni_session) -> ni_session_stats {
    let (status, st) = stats_sized(session, size_of::<ni_session_stats>());
    ok(status);
    st
}

fn session_with(params: &ni_session_params) -> *mut ni_session {
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { ni_session_create(shared_model(), params, &mut s) });
    s
}

#[test]
fn every_pool_gives_the_same_greedy_tokens_and_reports_itself() {
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[42, 7, 99], &[300, 301, 302, 303]];
    let mut reference = None;
    for (pool, reported) in [
        (NI_MEMORY_POOL_DEFAULT, NI_MEMORY_POOL_CPU_ARENA),
        (NI_MEMORY_POOL_CPU_ARENA, NI_MEMORY_POOL_CPU_ARENA),
        (NI_MEMORY_POOL_CPU_SLAB, NI_MEMORY_POOL_CPU_SLAB),
        (NI_MEMORY_POOL_SYSTEM, NI_MEMORY_POOL_SYSTEM),
    ] {
        let mut p = session_params();
        p.memory_pool = pool;
        let s = session_with(&p);
        for prompt in prompts {
            add_tokens(s, prompt, 8);
        }
        let out: Vec<Vec<u32>> = run_to_completion(s)
            .into_values()
            .map(|c| c.tokens)
            .collect();
        assert_eq!(out.len(), 3);
        match &reference {
            None => reference = Some(out),
            Some(r) => assert_eq!(&out, r, "pool {pool} changes the output"),
        }
        let st = stats(s);
        assert_eq!(st.memory_pool, reported, "pool {pool}");
        assert!(st.workspace_capacity_bytes > 0 || pool != NI_MEMORY_POOL_CPU_ARENA);
        if reported == NI_MEMORY_POOL_CPU_ARENA {
            // Sized once from the plan: one system allocation, no resize.
            assert_eq!(st.workspace_system_allocations, 1, "{st:?}");
            assert_eq!(st.workspace_resizes, 0);
            assert!(st.workspace_peak_bytes <= st.workspace_capacity_bytes);
            assert!(st.workspace_capacity_bytes <= st.memory_workspace_bytes);
        }
        // SAFETY: freed once.
        unsafe { ni_session_free(s) };
    }
}

#[test]
fn gpu_pools_are_refused_on_a_cpu_model() {
    for (pool, name) in [
        (NI_MEMORY_POOL_CUDA_STREAM, "cuda-stream"),
        (NI_MEMORY_POOL_CUDA_BUDDY, "cuda-buddy"),
    ] {
        let mut p = session_params();
        p.memory_pool = pool;
        let mut s = ptr::null_mut();
        // SAFETY: valid pointers.
        let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
        assert_err(
            status,
            NI_ERR_INVALID_ARGUMENT,
            &[name, "GPU pool", "cpu", "arena"],
        );
        assert!(s.is_null());
    }
    // The next value is not a pool.
    let mut p = session_params();
    p.memory_pool = NI_MEMORY_POOL_CUDA_BUDDY + 1;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    assert_err(status, NI_ERR_INVALID_ARGUMENT, &["memory_pool"]);
}

#[test]
fn budget_report_of_an_explicit_capacity() {
    let mut p = session_params();
    p.kv_capacity_tokens = 209; // not a multiple of the block size
    p.block_size = 16;
    let s = session_with(&p);
    let st = stats(s);
    assert_eq!(st.memory_budget_source, NI_BUDGET_TOKENS);
    assert_eq!(st.kv_capacity_tokens, 224, "rounded up to whole blocks");
    assert_eq!(st.kv_blocks, 14);
    assert_eq!(st.kv_block_size, 16);
    // SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K + V) x 4 bytes.
    assert_eq!(st.kv_bytes_per_token, 30 * 3 * 64 * 2 * 4);
    // Storage holds the null block too.
    assert_eq!(st.kv_memory_bytes, (224 + 16) * st.kv_bytes_per_token);
    assert_eq!(st.context_tokens, 8192);
    assert_eq!(st.max_full_context_seqs, 0);
    assert!(st.memory_weights_bytes > 500_000_000, "{st:?}"); // F32 weights
    assert!(st.memory_workspace_bytes > 0);
    assert!(st.memory_total_bytes >= st.memory_available_bytes);
    assert_eq!(st.memory_utilization, 0.0);
    // SAFETY: freed once.
    unsafe { ni_session_free(s) };
}

#[test]
fn utilization_budget_follows_the_vllm_rule() {
    // A fraction that leaves about 256 MiB for the KV cache on this machine.
    let probe = session_with(&session_params());
    let facts = stats(probe);
    // SAFETY: freed once.
    unsafe { ni_session_free(probe) };
    let want = facts.memory_weights_bytes + facts.memory_workspace_bytes + (256 << 20);
    let fraction = (want as f64 / facts.memory_total_bytes as f64) as f32;
    assert!(fraction > 0.0 && fraction < 1.0, "{facts:?}");

    let mut p = session_params();
    p.kv_capacity_tokens = 0;
    p.memory_utilization = fraction;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    if status == NI_ERR_OUT_OF_MEMORY {
        // A busy machine may not have the memory: the error must say why.
        let e = last_error();
        assert!(e.contains("KV") || e.contains("memory"), "{e}");
        return;
    }
    ok(status);
    let st = stats(s);
    assert_eq!(st.memory_budget_source, NI_BUDGET_UTILIZATION);
    assert_eq!(st.memory_utilization, fraction);
    let allowed = (st.memory_total_bytes as f64 * fraction as f64) as u64;
    let by_total = allowed - st.memory_weights_bytes - st.memory_workspace_bytes;
    let budget = if st.memory_limited_by_available {
        st.memory_available_bytes - st.memory_workspace_bytes
    } else {
        by_total
    };
    assert!(budget <= by_total);
    // The KV cache holds what the budget buys, rounded to whole blocks.
    let tokens = budget / st.kv_bytes_per_token;
    assert!(
        st.kv_capacity_tokens >= tokens && st.kv_capacity_tokens < tokens + st.kv_block_size,
        "{tokens} tokens budgeted, {st:?}"
    );
    assert_eq!(
        st.max_full_context_seqs,
        st.kv_blocks / st.context_tokens.div_ceil(st.kv_block_size)
    );
    // SAFETY: freed once.
    unsafe { ni_session_free(s) };

    // Weights alone exceed a tiny fraction: a clear out-of-memory error.
    p.memory_utilization = 0.001;
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    assert_err(
        status,
        NI_ERR_OUT_OF_MEMORY,
        &["weights", "memory utilization"],
    );
}

#[test]
fn too_small_a_byte_budget_is_a_clear_error() {
    let mut p = session_params();
    p.kv_capacity_tokens = 0;
    p.kv_memory_bytes = 1 << 20;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    assert_err(status, NI_ERR_OUT_OF_MEMORY, &["less than one context"]);
    assert!(s.is_null());
}

#[test]
fn kv_cache_dtype_fp8_is_refused_on_the_cpu_and_unknown_values_are_named() {
    let mut p = session_params();
    p.kv_cache_dtype = NI_KV_CACHE_DTYPE_FP8;
    let mut s = ptr::null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    assert_err(status, NI_ERR_UNSUPPORTED, &["fp8", "CUDA only"]);
    assert!(s.is_null());
    p.kv_cache_dtype = 7;
    // SAFETY: valid pointers.
    let status = unsafe { ni_session_create(shared_model(), &p, &mut s) };
    assert_err(status, NI_ERR_INVALID_ARGUMENT, &["kv_cache_dtype 7"]);
    assert!(s.is_null());
    p.kv_cache_dtype = NI_KV_CACHE_DTYPE_AUTO;
    let s = session_with(&p);
    // SAFETY: freed once.
    unsafe { ni_session_free(s) };
}

#[test]
fn older_struct_sizes_are_accepted() {
    // A params struct from the older header: no memory_utilization field.
    // Its bytes past the old size are garbage that must not be read.
    let mut p = session_params();
    p.memory_utilization = f32::NAN;
    p.struct_size = std::mem::offset_of!(ni_session_params, memory_utilization) as u32;
    let s = session_with(&p);

    let old = std::mem::offset_of!(ni_session_stats, memory_budget_source);
    // SAFETY: all-zero is a valid ni_session_stats.
    let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
    st.struct_size = old as u32;
    st.kv_memory_bytes = 12345; // past the old size: must stay untouched
                                // SAFETY: valid pointers.
    ok(unsafe { ni_session_get_stats(s, &mut st) });
    assert_eq!(st.struct_size as usize, old);
    assert_eq!(st.kv_capacity_tokens, 4096);
    assert_eq!(st.kv_memory_bytes, 12345);

    let (status, _) = stats_sized(s, old + 4);
    assert_err(status, NI_ERR_INVALID_ARGUMENT, &["struct_size"]);

    // The stats struct before the profiled peak was appended.
    let v2 = std::mem::offset_of!(ni_session_stats, memory_profiled_peak_bytes);
    let mut st: ni_session_stats = unsafe { std::mem::zeroed() };
    st.struct_size = v2 as u32;
    st.memory_profiled_peak_bytes = 777; // past the V2 size: untouched
                                         // SAFETY: valid pointers.
    ok(unsafe { ni_session_get_stats(s, &mut st) });
    assert_eq!(st.memory_pool, NI_MEMORY_POOL_CPU_ARENA);
    assert_eq!(st.memory_profiled_peak_bytes, 777);
    // The full struct: a CPU budget is never profiled.
    assert_eq!(stats(s).memory_profiled_peak_bytes, 0);
    // SAFETY: freed once.
    unsafe { ni_session_free(s) };
}
