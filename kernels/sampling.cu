// Sampling on the GPU: the CPU sampler's stage chain (src/sampling/) run on
// the logits where the LM head left them, one block per logits row.
//
// The host resolves each row into a record (SAMPLE_ROW_WORDS words, layout in
// src/backend/cuda/sampling.rs) plus token lists: the penalties' histories,
// the logit bias and the min_tokens suppression, and for a row under a
// structured-output grammar its allowed-token bitmask. The RNG stays on the host:
// every sampled row brings the uniform the CPU sampler would have drawn.
//
// Truncation keeps a prefix of the order (logit descending, id ascending),
// like the CPU's sorted candidate set, so the kept set is one cut: the last
// member's (key, id). Cuts are found by radix selection over the logits'
// order keys, 8 bits per pass, counting members (top-k) or summing their
// weights (top-p, the draw). Weights exp(l - max) are 40-bit fixed point:
// integer sums do not depend on the order of the atomics, so a seed gives
// the same tokens on every run.

#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_ROW_WORDS 16
#define SAMPLE_TEMPERATURE 1u
#define SAMPLE_TOP_K 2u
#define SAMPLE_TOP_P 4u
#define SAMPLE_MIN_P 8u
#define SAMPLE_REPETITION 16u
#define SAMPLE_ON_HOST 32u  // the host samples this row from its logits: leave them
// Launched before the row's previous token reached the host (overlapped
// steps): that token, ids[row] as the previous launch left it, is one more
// output token the lists do not hold (presence and frequency in words 13, 14).
#define SAMPLE_PENDING 64u
// Word 15: the offset in params of the row's grammar mask (vocab bits, bit
// t % 32 of word t / 32 set = token t allowed), 0 for none.
#define SAMPLE_MASK_AT 15
#define WEIGHT_ONE 1099511627776.0  // 2^40: the weight of the largest logit

typedef unsigned long long u64;

// Larger key = larger logit.
__device__ __forceinline__ unsigned order_key(float l) {
    const unsigned b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float from_order_key(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ u64 weight_of(float l, float max) {
    return (u64)(expf(l - max) * WEIGHT_ONE);
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ u64 block_sum_u64(u64 v) {
    return block_reduce(v, 0ull, [](u64 x) { return warp_sum_u64(x); });
}

__device__ u64 block_max_u64(u64 v) {
    return block_reduce(v, 0ull, [](u64 x) { return warp_max_u64(x); });
}

// The candidates: every non-NaN token up to the cut (key, id) in the order,
// and, once min-p applies, within `floor` of the largest logit.
struct Cut {
    unsigned key, id;
    bool min_p;
    float floor, max;
};

__device__ __forceinline__ bool member(float l, unsigned i, const Cut& c) {
    if (!(l == l)) return false;
    const unsigned k = order_key(l);
    if (k < c.key || (k == c.key && i > c.id)) return false;
    return !c.min_p || l - c.max >= c.floor;
}

// hist[d] += (count, weight) of the lanes with `on` and digit d: one pair of
// shared atomics per distinct digit of the warp, not per lane (the first
// passes put most tokens in a handful of bins). Every lane must call it.
__device__ __forceinline__ void hist_add(bool on, unsigned d, u64 w, bool by_mass, u64* hmass,
                                         unsigned* hcount) {
    unsigned pending = __ballot_sync(0xffffffffu, on);
    while (pending) {
        const int src = __ffs(pending) - 1;
        const unsigned bin = __shfl_sync(0xffffffffu, d, src);
        const bool mine = on && d == bin;
        const unsigned group = __ballot_sync(0xffffffffu, mine);
        const u64 s = by_mass ? warp_sum_u64(mine ? w : 0ull) : 0ull;
        if ((int)(threadIdx.x & 31) == src) {
            if (by_mass) atomicAdd(&hmass[bin], s);
            atomicAdd(&hcount[bin], (unsigned)__popc(group));
        }
        pending &= ~group;
    }
}

struct Group {
    unsigned key;
    u64 before;  // count or weight of the better groups
    u64 mass;
    unsigned count;
};

// Walking the members best first, the group of equal keys in which the
// running total (member count, or weight with `by_mass`) first exceeds `t`.
__device__ Group select_group(const float* row, int vocab, const Cut& c, bool by_mass, u64 t) {
    __shared__ u64 hmass[256];
    __shared__ unsigned hcount[256];
    __shared__ Group found;
    unsigned prefix = 0;
    u64 before = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const unsigned high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        for (int j = threadIdx.x; j < 256; j += blockDim.x) hmass[j] = 0, hcount[j] = 0;
        __syncthreads();
        for (int base = 0; base < vocab; base += blockDim.x) {
            const int i = base + threadIdx.x;
            bool on = false;
            unsigned d = 0;
            u64 w = 0;
            if (i < vocab) {
                const float l = row[i];
                const unsigned k = order_key(l);
                if (member(l, i, c) && (k & high) == prefix) {
                    on = true;
                    d = (k >> shift) & 255u;
                    w = by_mass ? weight_of(l, c.max) : 0ull;
                }
            }
            hist_add(on, d, w, by_mass, hmass, hcount);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d > 0; --d) {
                const u64 v = by_mass ? hmass[d] : (u64)hcount[d];
                if (before + v > t) break;
                before += v;
            }
            found.key = prefix | ((unsigned)d << shift);
            found.before = before;
            found.mass = hmass[d];
            found.count = hcount[d];
        }
        __syncthreads();
        prefix = found.key;
        before = found.before;
    }
    return found;
}

// The `nth` (1-based) smallest id among the members with key `key`.
__device__ unsigned select_id(const float* row, int vocab, const Cut& c, unsigned key, unsigned nth) {
    __shared__ unsigned hcount[256];
    __shared__ unsigned s_prefix, s_before;
    unsigned prefix = 0, before = 0;
    for (int shift = 16; shift >= 0; shift -= 8) {  // ids < 2^24
        for (int j = threadIdx.x; j < 256; j += blockDim.x) hcount[j] = 0;
        __syncthreads();
        for (int base = 0; base < vocab; base += blockDim.x) {
            const int i = base + threadIdx.x;
            bool on = false;
            if (i < vocab) {
                const float l = row[i];
                on = member(l, i, c) && order_key(l) == key &&
                     ((unsigned)i >> (shift + 8)) == (prefix >> (shift + 8));
            }
            hist_add(on, ((unsigned)i >> shift) & 255u, 0ull, false, nullptr, hcount);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 0;
            for (; d < 255; ++d) {
                if (before + hcount[d] >= nth) break;
                before += hcount[d];
            }
            s_prefix = prefix | ((unsigned)d << shift);
            s_before = before;
        }
        __syncthreads();
        prefix = s_prefix;
        before = s_before;
    }
    return prefix;
}

// The member at running weight `t`, best first: the group, then the id
// inside it (its members weigh the same).
__device__ unsigned member_at_mass(const float* row, int vocab, const Cut& c, u64 t, unsigned* key) {
    const Group g = select_group(row, vocab, c, true, t);
    *key = g.key;
    if (g.count <= 1 || g.mass == 0) return g.count == 1 ? 0xffffffffu : 0u;
    const u64 w = g.mass / g.count;
    return select_id(row, vocab, c, g.key, (unsigned)((t - g.before) / w) + 1u);
}

__device__ u64 member_mass(const float* row, int vocab, const Cut& c) {
    u64 total = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = row[i];
        if (member(l, i, c)) total += weight_of(l, c.max);
    }
    return block_sum_u64(total);
}

// The first member in id order whose running weight exceeds u * total
// (the CPU's draw over an unsorted candidate set); -1 when all weigh 0.
__device__ int draw_in_id_order(const float* row, int vocab, const Cut& c, double u) {
    __shared__ u64 warp_mass[32];
    __shared__ int s_warp, s_id;
    __shared__ u64 s_rest;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunk = ((vocab + warps - 1) / warps + 31) & ~31;
    const int begin = warp * chunk, end = min(vocab, begin + chunk);
    u64 mass = 0;
    for (int i = begin + lane; i < end; i += 32) {
        const float l = row[i];
        if (member(l, i, c)) mass += weight_of(l, c.max);
    }
    mass = warp_sum_u64(mass);
    if (lane == 0) warp_mass[warp] = mass;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 total = 0;
        for (int w = 0; w < warps; ++w) total += warp_mass[w];
        s_warp = -1;
        s_id = -1;
        if (total > 0) {
            u64 t = (u64)(u * (double)total);
            t = t < total ? t : total - 1;
            int w = 0;
            while (t >= warp_mass[w]) t -= warp_mass[w++];
            s_warp = w;
            s_rest = t;
        }
    }
    __syncthreads();
    if (warp == s_warp) {
        u64 run = 0;
        const u64 t = s_rest;
        for (int base = begin; base < end; base += 32) {
            const int i = base + lane;
            u64 w = 0;
            if (i < end) {
                const float l = row[i];
                if (member(l, i, c)) w = weight_of(l, c.max);
            }
            u64 incl = w;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 x = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += x;
            }
            const unsigned over = __ballot_sync(0xffffffffu, run + incl > t);
            if (over) {
                if (lane == 0) s_id = base + __ffs(over) - 1;
                break;
            }
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
    return s_id;
}

// The draw over a sorted candidate set: the first member, best first,
// whose running weight exceeds u * total; -1 when all weigh 0.
__device__ int draw_best_first(const float* row, int vocab, const Cut& c, double u) {
    __shared__ int s_only;
    const u64 total = member_mass(row, vocab, c);
    if (total == 0) return -1;
    u64 t = (u64)(u * (double)total);
    t = t < total ? t : total - 1;
    unsigned key;
    const unsigned id = member_at_mass(row, vocab, c, t, &key);
    if (id != 0xffffffffu) return (int)id;
    // The group has one member: find it.
    if (threadIdx.x == 0) s_only = -1;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = row[i];
        if (member(l, i, c) && order_key(l) == key) s_only = i;
    }
    __syncthreads();
    return s_only;
}

struct Truncation {
    bool top_k_on, top_p_on, min_p_on;
    unsigned top_k;
    float top_p, floor;
};

// Stages 6-9 over the whole row by radix selection: for rows whose
// candidates do not fit in shared memory.
__device__ int sample_by_radix(const float* row, int vocab, float max, const Truncation& tr, double u) {
    Cut c = {0u, 0xffffffffu, false, 0.f, max};
    if (tr.top_k_on) c.key = select_group(row, vocab, c, false, (u64)tr.top_k - 1).key;
    if (tr.top_p_on) {
        // The largest logit weighs WEIGHT_ONE, so the total is never 0. The
        // last kept member is the first whose running weight reaches p * total.
        const u64 total = member_mass(row, vocab, c);
        const double target = ceil((double)tr.top_p * (double)total);
        u64 t = target >= 1.0 ? (u64)target - 1 : 0;
        t = t < total ? t : total - 1;
        unsigned key;
        c.id = member_at_mass(row, vocab, c, t, &key);
        c.key = key;
    }
    c.min_p = tr.min_p_on;
    c.floor = tr.floor;
    return draw_best_first(row, vocab, c, u);
}

#define SAMPLE_CAP 4096  // candidates sorted in shared memory
#define NOT_COMPACTED (-2)

__device__ __forceinline__ unsigned list_id(u64 e) { return 0xffffffffu - (unsigned)(e & 0xffffffffu); }
__device__ __forceinline__ float list_logit(u64 e) { return from_order_key((unsigned)(e >> 32)); }

// Warp-wide over list[0, n): how many leading entries satisfy `pred`
// (which holds for a prefix of the list).
template <typename Pred>
__device__ int leading(int n, Pred pred) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += 32) {
        const bool ok = base + lane < n && pred(base + lane);
        const unsigned all = __ballot_sync(0xffffffffu, ok);
        if (all != 0xffffffffu) return base + __ffs(~all) - 1;
    }
    return n;
}

// Warp-wide: the first j < n whose running weight exceeds t, or -1.
__device__ int first_over(const u64* list, int n, float max, u64 t) {
    const int lane = threadIdx.x & 31;
    u64 run = 0;
    for (int base = 0; base < n; base += 32) {
        u64 incl = base + lane < n ? weight_of(list_logit(list[base + lane]), max) : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        const unsigned over = __ballot_sync(0xffffffffu, run + incl > t);
        if (over) return base + __ffs(over) - 1;
        run += __shfl_sync(0xffffffffu, incl, 31);
    }
    return -1;
}

__device__ u64 list_mass(const u64* list, int n, float max) {
    u64 total = 0;
    for (int j = threadIdx.x & 31; j < n; j += 32) total += weight_of(list_logit(list[j]), max);
    return warp_sum_u64(total);
}

// Stages 6-9 when top-k or top-p applies and a superset of the tokens they
// keep fits in shared memory (the usual case): those tokens are compacted,
// sorted best first, and the cuts and the draw walk the sorted list. Returns
// NOT_COMPACTED when the superset is too large.
__device__ int sample_compacted(const float* row, int vocab, float max, const Truncation& tr, double u) {
    __shared__ u64 list[SAMPLE_CAP];
    __shared__ int s_n, s_token;
    __shared__ unsigned s_low;
    unsigned low_key = 0;
    u64 total = 0, light = 0;
    if (tr.top_k_on) {
        // A 4096-bin histogram of the keys' top bits: the bin holding the
        // k-th best token bounds the top-k set from below.
        unsigned* hist = (unsigned*)list;
        for (int j = threadIdx.x; j < 4096; j += blockDim.x) hist[j] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i];
            if (l == l) atomicAdd(&hist[order_key(l) >> 20], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned bin = order_key(max) >> 20, count = 0;
            for (;; --bin) {
                count += hist[bin];
                if (count >= tr.top_k || bin == 0) break;
            }
            s_low = bin << 20;
            s_n = (int)count;
        }
        __syncthreads();
        if (s_n > SAMPLE_CAP) return NOT_COMPACTED;
        low_key = s_low;
    } else {
        // Tokens lighter than (1 - p) * total / vocab weigh less than
        // (1 - p) * total together: all lie in the tail top-p removes. Half
        // that bound leaves room for rounding.
        const Cut all = {0u, 0xffffffffu, false, 0.f, max};
        total = member_mass(row, vocab, all);
        light = (u64)((1.0 - (double)tr.top_p) * (double)total / vocab * 0.5);
    }
    __syncthreads();
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = row[i];
        if (!(l == l)) continue;
        const unsigned k = order_key(l);
        if (tr.top_k_on ? k >= low_key : weight_of(l, max) >= light) {
            const int at = atomicAdd(&s_n, 1);
            if (at < SAMPLE_CAP) list[at] = ((u64)k << 32) | (0xffffffffu - (unsigned)i);
        }
    }
    __syncthreads();
    const int n = s_n;
    if (n > SAMPLE_CAP) return NOT_COMPACTED;
    // Bitonic sort, best first (larger entry = larger logit, then smaller id).
    int m = 1;
    while (m < n) m <<= 1;
    for (int j = n + threadIdx.x; j < m; j += blockDim.x) list[j] = 0;
    __syncthreads();
    for (int k = 2; k <= m; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < m; i += blockDim.x) {
                const int other = i ^ j;
                if (other > i) {
                    const u64 a = list[i], b = list[other];
                    if (((i & k) == 0) ? a < b : a > b) list[i] = b, list[other] = a;
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x < 32) {
        int keep = n;
        if (tr.top_k_on) {
            const u64 kth = list[tr.top_k - 1] >> 32;
            keep = leading(n, [&](int j) { return (list[j] >> 32) >= kth; });
        }
        if (tr.top_p_on) {
            if (tr.top_k_on) total = list_mass(list, keep, max);
            const double target = ceil((double)tr.top_p * (double)total);
            u64 t = target >= 1.0 ? (u64)target - 1 : 0;
            t = t < total ? t : total - 1;
            const int last = first_over(list, keep, max, t);
            if (last >= 0) keep = last + 1;
        }
        if (tr.min_p_on) keep = leading(keep, [&](int j) { return list_logit(list[j]) - max >= tr.floor; });
        const u64 mass = list_mass(list, keep, max);
        int token = -1;
        if (mass > 0) {
            u64 t = (u64)(u * (double)mass);
            t = t < mass ? t : mass - 1;
            const int j = first_over(list, keep, max, t);
            token = j >= 0 ? (int)list_id(list[j]) : -1;
        }
        if (threadIdx.x == 0) s_token = token;
    }
    __syncthreads();
    return s_token;
}

// Whether token t is in the n-entry list of (token, value) pairs at edit
// (the whole block calls it).
__device__ bool block_list_has(const unsigned* edit, unsigned n, unsigned t) {
    __shared__ int s_has;
    if (threadIdx.x == 0) s_has = 0;
    __syncthreads();
    for (unsigned j = threadIdx.x; j < n; j += blockDim.x)
        if (edit[2 * j] == t) s_has = 1;
    __syncthreads();
    return s_has;
}

// ids[r] = the token sampled from logits row r. The row is processed in
// place (penalties, bias, suppression, temperature), as the CPU sampler does.
// Rows marked SAMPLE_ON_HOST are left untouched.
// grid = rows, block = SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(float* logits, int vocab, int choosable, const unsigned* params, unsigned* ids) {
    GRID_DEP_ENTER();
    float* row = logits + (size_t)blockIdx.x * vocab;
    const unsigned* p = params + (size_t)blockIdx.x * SAMPLE_ROW_WORDS;
    const unsigned flags = p[0];
    if (flags & SAMPLE_ON_HOST) return;
    const unsigned* edit = params + p[8];
    const unsigned n_rep = p[9], n_pen = p[10], n_bias = p[11], n_ban = p[12];
    // Read before thread 0 writes this row's id below.
    const unsigned pending = flags & SAMPLE_PENDING ? ids[blockIdx.x] : 0xffffffffu;
    const bool pending_in_vocab = pending < (unsigned)vocab;
    // A row the model made non-finite (NaN or infinity, before any stage
    // writes -inf) gets 0xffffffff, the engine's NON_FINITE_ROW: its
    // request ends with an error, as on the CPU.
    int non_finite = 0;
    for (int i = threadIdx.x; i < choosable; i += blockDim.x) non_finite |= !isfinite(row[i]);
    if (__syncthreads_or(non_finite)) {
        if (threadIdx.x == 0) ids[blockIdx.x] = 0xffffffffu;
        return;
    }
    // The columns past the tokenizer (padding rows of the head) have no
    // text: never chosen, as on the CPU, which samples only the others.
    for (int i = choosable + threadIdx.x; i < vocab; i += blockDim.x) row[i] = -NI_INF;
    __syncthreads();
    // Stage 0, the grammar: before everything else, as on the CPU, so the
    // later stages only weigh allowed tokens.
    if (p[SAMPLE_MASK_AT]) {
        const unsigned* mask = params + p[SAMPLE_MASK_AT];
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (!((mask[i >> 5] >> (i & 31)) & 1u)) row[i] = -NI_INF;
        __syncthreads();
    }
    // Stages 1-4, each over distinct tokens except the bias (one thread, in
    // list order, as repeated ids add up on the CPU).
    if (flags & SAMPLE_REPETITION) {
        const float penalty = __uint_as_float(p[5]);
        for (unsigned j = threadIdx.x; j < n_rep; j += blockDim.x) {
            const unsigned t = edit[2 * j];
            if (t < (unsigned)vocab) row[t] = row[t] < 0.f ? row[t] * penalty : row[t] / penalty;
        }
        __syncthreads();
        // The pending token, once, unless the list has it.
        if (pending_in_vocab && !block_list_has(edit, n_rep, pending) && threadIdx.x == 0) {
            const float l = row[pending];
            row[pending] = l < 0.f ? l * penalty : l / penalty;
        }
    }
    edit += 2 * n_rep;
    __syncthreads();
    for (unsigned j = threadIdx.x; j < n_pen; j += blockDim.x) {
        const unsigned t = edit[2 * j];
        if (t < (unsigned)vocab) row[t] -= __uint_as_float(edit[2 * j + 1]);
    }
    __syncthreads();
    if (pending_in_vocab) {
        // One more occurrence: its frequency, and its presence if it is new.
        const float presence = __uint_as_float(p[13]), frequency = __uint_as_float(p[14]);
        const bool seen = block_list_has(edit, n_pen, pending);
        if (threadIdx.x == 0) row[pending] -= seen ? frequency : frequency + presence;
    }
    edit += 2 * n_pen;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned j = 0; j < n_bias; ++j) {
            const unsigned t = edit[2 * j];
            if (t < (unsigned)vocab) row[t] += __uint_as_float(edit[2 * j + 1]);
        }
    }
    edit += 2 * n_bias;
    __syncthreads();
    for (unsigned j = threadIdx.x; j < n_ban; j += blockDim.x) {
        const unsigned t = edit[2 * j];
        if (t < (unsigned)vocab) row[t] = -NI_INF;
    }
    __syncthreads();

    // Stage 5 and the argmax (the greedy token, and the fallback of a
    // degenerate row).
    const bool sampled = flags & SAMPLE_TEMPERATURE;
    const float temperature = __uint_as_float(p[1]);
    u64 best = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float l = row[i];
        if (sampled) row[i] = l = l / temperature;
        if (l == l) {
            const u64 key = argmax_key(l, i);
            best = key > best ? key : best;
        }
    }
    best = block_max_u64(best);
    const unsigned argmax = best ? 0xffffffffu - (unsigned)(best & 0xffffffffu) : 0u;
    const float max = from_order_key((unsigned)(best >> 32));
    if (!sampled || best == 0 || !(max < NI_INF && max > -NI_INF)) {
        if (threadIdx.x == 0) ids[blockIdx.x] = argmax;
        return;
    }

    // Stages 6-9.
    const double u = __hiloint2double((int)p[7], (int)p[6]);
    Truncation tr;
    tr.top_k = p[2];
    tr.top_k_on = (flags & SAMPLE_TOP_K) && tr.top_k > 0 && tr.top_k < (unsigned)vocab;
    tr.top_p_on = flags & SAMPLE_TOP_P;
    tr.min_p_on = flags & SAMPLE_MIN_P;
    tr.top_p = __uint_as_float(p[3]);
    tr.floor = __uint_as_float(p[4]);
    int token;
    if (!tr.top_k_on && !tr.top_p_on) {
        // No sorted truncation: the CPU draws in id order.
        const Cut c = {0u, 0xffffffffu, tr.min_p_on, tr.floor, max};
        token = draw_in_id_order(row, vocab, c, u);
    } else {
        token = sample_compacted(row, vocab, max, tr, u);
        if (token == NOT_COMPACTED) token = sample_by_radix(row, vocab, max, tr, u);
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = token >= 0 ? (unsigned)token : argmax;
}
