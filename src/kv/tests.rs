//! Shared behaviour suite run against every `KvCacheBackend` configuration
//! (paged with block sizes 1, 4 and 16, and the token pool).
//!
//! The soak test keeps a shadow of what every physical slot holds (a hash of
//! the salt and the whole prefix up to that position) and checks after every
//! operation that each live sequence still reads exactly its own KV, and that
//! no write ever lands on a slot another live sequence maps.

use std::collections::{BTreeMap, HashSet};

use super::{create_kv_backend, KvBackendKind, KvCacheBackend, KvStats, SeqId};

#[derive(Clone, Copy, Debug)]
struct Backend {
    kind: KvBackendKind,
    block_size: usize,
}

impl Backend {
    fn make(&self, capacity: usize, prefix_caching: bool) -> (Box<dyn KvCacheBackend>, usize) {
        create_kv_backend(self.kind, capacity, self.block_size, prefix_caching)
    }

    /// Caching granularity in tokens.
    fn g(&self) -> usize {
        match self.kind {
            KvBackendKind::Paged => self.block_size,
            KvBackendKind::Token => 1,
        }
    }

    /// Slots a sequence of `n` tokens occupies.
    fn rounded(&self, n: usize) -> usize {
        n.div_ceil(self.g()) * self.g()
    }
}

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

/// `n` tokens from a range no other call with a different `tag` uses.
fn distinct_tokens(tag: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| tag * 100_000 + i).collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

fn slots(kv: &dyn KvCacheBackend, seq: SeqId, n: usize) -> Vec<usize> {
    let m = kv.mapping(seq);
    assert!(
        m.capacity() >= n,
        "mapping of seq {seq} covers {} < {n} positions",
        m.capacity()
    );
    (0..n).map(|p| m.slot(p)).collect()
}

fn all_mapped_slots(kv: &dyn KvCacheBackend, seq: SeqId) -> Vec<usize> {
    slots(kv, seq, kv.mapping(seq).capacity())
}

fn check(kv: &dyn KvCacheBackend) {
    if let Err(e) = kv.check_invariants() {
        panic!("invariant violated: {e}");
    }
    let st = kv.stats();
    assert_eq!(
        st.free_slots + st.evictable_slots + st.used_slots,
        st.total_slots,
        "{st:?}"
    );
    assert_eq!(
        kv.available_slots(),
        st.free_slots + st.evictable_slots,
        "{st:?}"
    );
}

/// Begins, allocates and commits a whole prompt; returns the cached length.
fn run_prompt(kv: &mut dyn KvCacheBackend, seq: SeqId, tokens: &[u32], salt: u64) -> usize {
    let cached = kv.begin(seq, tokens, salt);
    assert!(
        kv.allocate(seq, tokens.len()),
        "room for seq {seq} ({} tokens)",
        tokens.len()
    );
    kv.commit(seq, tokens);
    check(kv);
    cached
}

fn assert_idle(kv: &dyn KvCacheBackend) {
    check(kv);
    let st = kv.stats();
    assert_eq!(st.used_slots, 0, "{st:?}");
    assert_eq!(st.free_slots + st.evictable_slots, st.total_slots, "{st:?}");
    assert_eq!(kv.available_slots(), st.total_slots);
}

fn physical_layout(b: Backend) {
    let (kv, physical) = b.make(100, true);
    let st = kv.stats();
    assert_eq!(st.total_slots, b.rounded(100));
    assert_eq!(st.granularity, b.g());
    assert_eq!(
        physical,
        st.total_slots + b.g(),
        "one reserved null block / dummy slot"
    );
    assert_eq!(kv.kind(), b.kind);
    assert_idle(kv.as_ref());
}

fn unique_slots_and_mapping(b: Backend) {
    for pc in [false, true] {
        let (mut kv, physical) = b.make(512, pc);
        let lens = [37, 64, 100, 5, 150];
        for (i, &n) in lens.iter().enumerate() {
            let seq = i as SeqId + 1;
            let toks = distinct_tokens(seq as u32, n);
            assert_eq!(kv.begin(seq, &toks, 0), 0, "nothing cached yet");
            assert!(kv.allocate(seq, n));
            check(kv.as_ref());
        }
        let mut seen = HashSet::new();
        for (i, &n) in lens.iter().enumerate() {
            let seq = i as SeqId + 1;
            let all = all_mapped_slots(kv.as_ref(), seq);
            assert!(all.len() >= n);
            for s in all {
                assert!(s > 0 && s < physical, "slot {s} outside 1..{physical}");
                assert!(seen.insert(s), "slot {s} handed to two live sequences");
            }
        }
        let used: usize = lens.iter().map(|&n| b.rounded(n)).sum();
        assert_eq!(kv.stats().used_slots, used);
        // Growing one sequence keeps its existing slots.
        let before = slots(kv.as_ref(), 1, 37);
        assert!(kv.allocate(1, 60));
        assert_eq!(slots(kv.as_ref(), 1, 37), before);
        assert!(kv.allocate(1, 10), "shrinking requests are no-ops");
        assert_eq!(slots(kv.as_ref(), 1, 60)[..37], before[..]);
        check(kv.as_ref());
    }
}

fn snapshot(kv: &dyn KvCacheBackend, seqs: &[SeqId]) -> (KvStats, usize, Vec<Vec<usize>>) {
    let maps = seqs.iter().map(|&s| all_mapped_slots(kv, s)).collect();
    (kv.stats(), kv.available_slots(), maps)
}

fn allocate_beyond_capacity_changes_nothing(b: Backend) {
    for pc in [false, true] {
        let (mut kv, _) = b.make(256, pc);
        kv.begin(1, &distinct_tokens(1, 100), 0);
        assert!(kv.allocate(1, 100));
        kv.begin(2, &distinct_tokens(2, 200), 0);
        let before = snapshot(kv.as_ref(), &[1, 2]);
        assert!(!kv.allocate(2, 200));
        assert_eq!(
            snapshot(kv.as_ref(), &[1, 2]),
            before,
            "a failed allocate must change nothing"
        );
        assert!(!kv.allocate(1, b.rounded(100) + kv.available_slots() + 1));
        assert_eq!(snapshot(kv.as_ref(), &[1, 2]), before);
        assert!(!kv.allocate(99, 1), "unknown sequences get nothing");
        let room = 256 - b.rounded(100);
        assert!(kv.allocate(2, room), "exactly the remaining room fits");
        assert_eq!(kv.available_slots(), 0);
        let full = snapshot(kv.as_ref(), &[1, 2]);
        assert!(!kv.allocate(2, room + 1));
        assert_eq!(snapshot(kv.as_ref(), &[1, 2]), full);
        check(kv.as_ref());
    }
}

fn release_returns_everything(b: Backend) {
    for pc in [false, true] {
        let (mut kv, _) = b.make(600, pc);
        let prefix = distinct_tokens(1, 64);
        for seq in 1..=4u64 {
            let toks = cat(&prefix, &distinct_tokens(seq as u32 + 1, 10 * seq as usize));
            run_prompt(kv.as_mut(), seq, &toks, 0);
        }
        for seq in [2, 4, 1, 3] {
            kv.release(seq);
            check(kv.as_ref());
        }
        assert_idle(kv.as_ref());
        if !pc {
            assert_eq!(kv.stats().free_slots, kv.stats().total_slots);
        }
        // Double release and unknown ids are harmless.
        let before = kv.stats();
        kv.release(3);
        kv.release(12345);
        kv.commit(12345, &prefix);
        assert_eq!(kv.mapping(12345).capacity(), 0);
        assert_eq!(kv.stats(), before);
        assert_idle(kv.as_ref());
    }
}

fn prefix_reuse(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(1024, true);
    let p = distinct_tokens(1, 200);
    let a = cat(&p, &distinct_tokens(2, 50));
    assert_eq!(run_prompt(kv.as_mut(), 1, &a, 0), 0);
    let bt = cat(&p, &distinct_tokens(3, 30));
    let expected = 200 / g * g;
    assert_eq!(
        kv.begin(2, &bt, 0),
        expected,
        "shared 200-token prefix, granularity {g}"
    );
    let st = kv.stats();
    assert_eq!(
        (st.prefix_hits, st.prefix_tokens_reused),
        (1, expected as u64)
    );
    let a_slots = slots(kv.as_ref(), 1, 250);
    assert_eq!(
        slots(kv.as_ref(), 2, expected),
        a_slots[..expected],
        "prefix maps to the same slots"
    );
    assert!(kv.allocate(2, bt.len()));
    kv.commit(2, &bt);
    check(kv.as_ref());
    let b_slots = slots(kv.as_ref(), 2, bt.len());
    let a_set: HashSet<_> = all_mapped_slots(kv.as_ref(), 1).into_iter().collect();
    assert!(
        b_slots[expected..].iter().all(|s| !a_set.contains(s)),
        "fresh part is private"
    );

    // The owner leaving does not take the shared prefix away from seq 2,
    // even when someone else takes all remaining memory.
    kv.release(1);
    check(kv.as_ref());
    assert_eq!(slots(kv.as_ref(), 2, bt.len()), b_slots);
    let hog = distinct_tokens(9, 10);
    kv.begin(3, &hog, 0);
    assert!(kv.allocate(3, kv.available_slots()));
    let b_set: HashSet<_> = all_mapped_slots(kv.as_ref(), 2).into_iter().collect();
    assert!(all_mapped_slots(kv.as_ref(), 3)
        .iter()
        .all(|s| !b_set.contains(s)));
    kv.release(3);
    kv.release(2);
    assert_idle(kv.as_ref());

    // A prompt equal to a cached one still leaves its last token to compute.
    let (mut kv, _) = b.make(1024, true);
    run_prompt(kv.as_mut(), 1, &a, 0);
    kv.release(1);
    assert_eq!(kv.begin(2, &a, 0), (a.len() - 1) / g * g);
    assert_eq!(kv.begin(3, &p, 0), (p.len() - 1) / g * g);
    assert_eq!(kv.begin(4, &a[..1], 0), 0, "a one-token prompt never hits");
    assert_eq!(kv.begin(5, &[], 0), 0);
    check(kv.as_ref());
}

fn partial_commits(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(256, true);
    let t = distinct_tokens(1, 40);
    kv.begin(1, &t, 0);
    assert!(kv.allocate(1, 10));
    kv.commit(1, &t[..10]);
    check(kv.as_ref());
    assert_eq!(
        kv.begin(2, &t, 0),
        10 / g * g,
        "only what was committed (in full blocks) is reused"
    );
    kv.release(2);
    // Committing in several steps, as chunked prefill and decode do.
    assert!(kv.allocate(1, 40));
    kv.commit(1, &t[..23]);
    kv.commit(1, &t[..23]);
    kv.commit(1, &t[..40]);
    kv.commit(1, &t[..5]);
    check(kv.as_ref());
    assert_eq!(kv.begin(2, &t, 0), 39 / g * g);
    // Commit beyond what was allocated is clamped, never a panic.
    let u = distinct_tokens(2, 64);
    kv.begin(3, &u, 0);
    assert!(kv.allocate(3, 10));
    kv.commit(3, &u);
    check(kv.as_ref());
    assert!(kv.begin(4, &u, 0) <= b.rounded(10));
    check(kv.as_ref());
}

fn truncate_frees_rejected_positions(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(256, true);
    let free = kv.stats().free_slots;
    let t = distinct_tokens(1, 40);
    kv.begin(1, &t, 0);
    assert!(kv.allocate(1, 21));
    kv.commit(1, &t[..21]);
    // Five speculative positions, two accepted.
    assert!(kv.allocate(1, 27));
    kv.commit(1, &t[..24]);
    kv.truncate(1, 24);
    check(kv.as_ref());
    assert_eq!(kv.stats().used_slots, b.rounded(24));
    assert_eq!(kv.stats().free_slots, free - b.rounded(24));
    // Unknown sequences are ignored.
    kv.truncate(7, 0);
    check(kv.as_ref());
    kv.release(1);
    assert_idle(kv.as_ref());
    // Only committed positions are ever reused.
    let u = cat(&t[..24], &distinct_tokens(2, 8));
    assert_eq!(kv.begin(2, &u, 0), 24 / g * g);
    kv.release(2);
}

fn salts_isolate(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(512, true);
    let t = distinct_tokens(1, 100);
    run_prompt(kv.as_mut(), 1, &t, 7);
    assert_eq!(kv.begin(2, &t, 8), 0, "another salt sees nothing");
    assert_eq!(kv.begin(3, &t, 0), 0);
    assert_eq!(kv.begin(4, &t, 7), 99 / g * g);
    let s2: HashSet<_> = all_mapped_slots(kv.as_ref(), 2).into_iter().collect();
    assert!(s2.is_empty());
    for s in 1..=4 {
        kv.release(s);
    }
    assert_eq!(kv.begin(5, &t, 8), 0, "still isolated after release");
    assert_eq!(kv.begin(6, &t, 7), 99 / g * g);
    check(kv.as_ref());
}

fn lru_eviction(b: Backend) {
    let (mut kv, _) = b.make(256, true);
    let pa = distinct_tokens(1, 96);
    let pb = distinct_tokens(2, 96);
    run_prompt(kv.as_mut(), 1, &pa, 0);
    kv.release(1); // released first: least recently used
    run_prompt(kv.as_mut(), 2, &pb, 0);
    kv.release(2);
    let st = kv.stats();
    assert_eq!((st.evictable_slots, st.free_slots), (192, 64));
    // Needs 128: 64 free, then 64 evicted from the tail of A's prefix.
    kv.begin(3, &distinct_tokens(3, 128), 0);
    assert!(kv.allocate(3, 128));
    assert_eq!(kv.stats().evictable_slots, 128);
    check(kv.as_ref());
    kv.release(3);
    assert_eq!(
        kv.begin(4, &cat(&pa, &[7]), 0),
        32,
        "A keeps its first 32 tokens"
    );
    assert_eq!(kv.begin(5, &cat(&pb, &[7]), 0), 96, "B is untouched");
    kv.release(4);
    kv.release(5);
    // Taking all memory evicts everything.
    kv.begin(6, &distinct_tokens(4, 256), 0);
    assert!(kv.allocate(6, 256));
    assert_eq!(kv.stats().evictable_slots, 0);
    kv.release(6);
    assert_eq!(kv.begin(7, &cat(&pb, &[7]), 0), 0);
    kv.release(7);
    assert_idle(kv.as_ref());
}

fn hits_refresh_lru(b: Backend) {
    let (mut kv, _) = b.make(256, true);
    let pa = distinct_tokens(1, 64);
    let pb = distinct_tokens(2, 64);
    run_prompt(kv.as_mut(), 1, &pa, 0);
    kv.release(1);
    run_prompt(kv.as_mut(), 2, &pb, 0);
    kv.release(2);
    // Reusing A makes it more recent than B, so B is evicted first.
    assert_eq!(kv.begin(3, &cat(&pa, &[5]), 0), 64);
    kv.release(3);
    kv.begin(4, &distinct_tokens(3, 128 + 32), 0);
    assert!(kv.allocate(4, 128 + 32));
    kv.release(4);
    assert_eq!(kv.begin(5, &cat(&pa, &[5]), 0), 64);
    assert_eq!(kv.begin(6, &cat(&pb, &[5]), 0), 32);
    check(kv.as_ref());
}

fn prefix_caching_off(b: Backend) {
    let (mut kv, _) = b.make(512, false);
    let t = distinct_tokens(1, 150);
    for round in 0..3 {
        assert_eq!(run_prompt(kv.as_mut(), round, &t, 0), 0);
        assert_eq!(kv.stats().evictable_slots, 0);
        kv.release(round);
        let st = kv.stats();
        assert_eq!((st.free_slots, st.evictable_slots), (st.total_slots, 0));
    }
    assert_eq!(kv.stats().prefix_hits, 0);
    assert_idle(kv.as_ref());
}

fn concurrent_duplicate_prefill(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(512, true);
    let t = distinct_tokens(1, 100);
    // Both start before either has committed, so both compute the prompt.
    assert_eq!(kv.begin(1, &t, 0), 0);
    assert_eq!(kv.begin(2, &t, 0), 0);
    assert!(kv.allocate(1, 100) && kv.allocate(2, 100));
    kv.commit(1, &t);
    kv.commit(2, &t);
    check(kv.as_ref());
    let used = kv.stats().used_slots;
    match b.kind {
        // Duplicate blocks are not registered twice; both stay allocated.
        KvBackendKind::Paged => assert_eq!(used, 2 * b.rounded(100)),
        // The second sequence switches to the tree's slots and frees its own.
        KvBackendKind::Token => {
            assert_eq!(used, 100);
            assert_eq!(slots(kv.as_ref(), 1, 100), slots(kv.as_ref(), 2, 100));
        }
    }
    kv.release(1);
    check(kv.as_ref());
    assert_eq!(kv.begin(3, &cat(&t, &[1]), 0), 100 / g * g);
    kv.release(2);
    kv.release(3);
    assert_idle(kv.as_ref());
}

fn restart_replaces_sequence(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(256, true);
    let t = distinct_tokens(1, 80);
    run_prompt(kv.as_mut(), 1, &t, 0);
    let used = kv.stats().used_slots;
    // Preempted and restarted under the same id: the old state is released first.
    assert_eq!(kv.begin(1, &cat(&t, &[3]), 0), 80 / g * g);
    assert_eq!(kv.stats().used_slots, 80 / g * g);
    assert!(used >= kv.stats().used_slots);
    assert!(kv.allocate(1, 81));
    check(kv.as_ref());
    kv.release(1);
    assert_idle(kv.as_ref());
}

// ---- randomized soak ----------------------------------------------------

struct Live {
    tokens: Vec<u32>,
    /// ids[p]: identity of the KV at position p (salt + tokens[..=p]).
    ids: Vec<u64>,
    salt: u64,
    computed: usize,
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_add(0x632b_e59b_d9b4_e019);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1 // 0 means "never written"
}

impl Live {
    fn new(tokens: Vec<u32>, salt: u64) -> Self {
        let mut l = Live {
            tokens: Vec::new(),
            ids: Vec::new(),
            salt,
            computed: 0,
        };
        for t in tokens {
            l.push(t);
        }
        l
    }
    fn push(&mut self, t: u32) {
        let prev = self.ids.last().copied().unwrap_or(mix(0xdead, self.salt));
        self.ids.push(mix(prev, t as u64));
        self.tokens.push(t);
    }
}

struct Sim {
    kv: Box<dyn KvCacheBackend>,
    physical: usize,
    shadow: Vec<u64>,
    live: BTreeMap<SeqId, Live>,
    g: usize,
    prefix_caching: bool,
    rng: Rng,
    prefixes: Vec<Vec<u32>>,
    next_id: SeqId,
    failed_allocs: usize,
}

impl Sim {
    fn verify(&self, id: SeqId) {
        let l = &self.live[&id];
        let s = slots(self.kv.as_ref(), id, l.computed);
        for (p, &slot) in s.iter().enumerate() {
            assert!(
                slot > 0 && slot < self.physical,
                "seq {id} pos {p} maps to slot {slot}"
            );
            assert_eq!(
                self.shadow[slot], l.ids[p],
                "seq {id} pos {p} (slot {slot}) reads foreign KV"
            );
        }
    }

    fn verify_all(&self) {
        check(self.kv.as_ref());
        for &id in self.live.keys() {
            self.verify(id);
        }
    }

    fn prompt(&mut self) -> Vec<u32> {
        let k = self.rng.below(self.prefixes.len() + 1);
        let mut t = match self.prefixes.get(k) {
            Some(p) => p[..self.rng.range(0, p.len())].to_vec(),
            None => Vec::new(),
        };
        let suffix = self.rng.range(1, 80);
        let small_vocab = self.rng.below(3) == 0;
        for _ in 0..suffix {
            let v = if small_vocab {
                self.rng.below(3)
            } else {
                self.rng.below(50_000)
            };
            t.push(v as u32);
        }
        t
    }

    fn begin(&mut self, id: SeqId, tokens: Vec<u32>, salt: u64) {
        let cached = self.kv.begin(id, &tokens, salt);
        assert!(
            cached < tokens.len().max(1),
            "cached {cached} of a {}-token prompt",
            tokens.len()
        );
        assert_eq!(cached % self.g, 0, "cached length must be whole blocks");
        if !self.prefix_caching {
            assert_eq!(cached, 0);
        }
        let mut l = Live::new(tokens, salt);
        l.computed = cached;
        self.live.insert(id, l);
        self.verify(id);
    }

    fn step(&mut self, id: SeqId) -> bool {
        let decode = self.rng.below(2) == 0;
        let chunk = if decode { 1 } else { self.rng.range(1, 64) };
        let l = self.live.get_mut(&id).unwrap();
        if l.computed == l.tokens.len() {
            let t = self.rng.below(50_000) as u32;
            l.push(t);
        }
        let target = (l.computed + chunk).min(l.tokens.len());
        let ids: Vec<SeqId> = self.live.keys().copied().collect();
        let before = snapshot(self.kv.as_ref(), &ids);
        if !self.kv.allocate(id, target) {
            assert_eq!(
                snapshot(self.kv.as_ref(), &ids),
                before,
                "failed allocate changed state"
            );
            self.failed_allocs += 1;
            return false;
        }
        let others: HashSet<usize> = ids
            .iter()
            .filter(|&&o| o != id)
            .flat_map(|&o| all_mapped_slots(self.kv.as_ref(), o))
            .collect();
        let l = &self.live[&id];
        let s = slots(self.kv.as_ref(), id, target);
        let own: HashSet<usize> = s[..l.computed].iter().copied().collect();
        let mut written = HashSet::new();
        for (p, &slot) in s.iter().enumerate().skip(l.computed) {
            assert!(
                written.insert(slot),
                "seq {id} maps two positions to slot {slot}"
            );
            assert!(slot > 0 && slot < self.physical, "slot {slot} out of range");
            assert!(
                !others.contains(&slot),
                "seq {id} writes slot {slot} that another seq maps"
            );
            assert!(
                !own.contains(&slot),
                "seq {id} overwrites its own computed prefix"
            );
            self.shadow[slot] = l.ids[p];
        }
        let tokens = l.tokens[..target].to_vec();
        self.kv.commit(id, &tokens);
        self.live.get_mut(&id).unwrap().computed = target;
        true
    }

    /// A speculative decode step: the pending token and `k` drafted ones
    /// are written, a random number of drafts is accepted and the rest are
    /// truncated away. False when the KV did not have room.
    fn speculate(&mut self, id: SeqId) -> bool {
        let l = self.live.get_mut(&id).unwrap();
        if l.computed == l.tokens.len() {
            let t = self.rng.below(50_000) as u32;
            l.push(t);
        }
        if l.tokens.len() != l.computed + 1 {
            return true; // still prefilling
        }
        let k = self.rng.range(1, 6);
        let mut drafted = Live::new(l.tokens.clone(), l.salt);
        for _ in 0..k {
            drafted.push(self.rng.below(50_000) as u32);
        }
        let (computed, target) = (l.computed, l.computed + 1 + k);
        if !self.kv.allocate(id, target) {
            self.failed_allocs += 1;
            return false;
        }
        let s = slots(self.kv.as_ref(), id, target);
        for (&slot, &id) in s[computed..target].iter().zip(&drafted.ids[computed..]) {
            self.shadow[slot] = id;
        }
        let accepted = self.rng.below(k + 1);
        let l = self.live.get_mut(&id).unwrap();
        for p in 0..accepted {
            l.push(drafted.tokens[computed + 1 + p]);
        }
        // The target's own token after the accepted drafts: never the
        // rejected draft, whose KV must not be read as this one's.
        let rejected = drafted.tokens.get(computed + 1 + accepted).copied();
        let t = (self.rng.below(50_000) as u32..).find(|&t| Some(t) != rejected);
        l.push(t.expect("some token differs"));
        l.computed = computed + 1 + accepted;
        let tokens = l.tokens[..l.computed].to_vec();
        self.kv.commit(id, &tokens);
        self.kv.truncate(id, tokens.len());
        let held = self.kv.mapping(id).capacity();
        assert!(
            held >= tokens.len() && held < tokens.len() + self.g,
            "truncated to {} positions, still maps {held}",
            tokens.len()
        );
        true
    }

    fn pick(&mut self) -> Option<SeqId> {
        let ids: Vec<SeqId> = self.live.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[self.rng.below(ids.len())])
    }

    fn release(&mut self, id: SeqId) {
        self.kv.release(id);
        self.live.remove(&id);
    }
}

fn soak(b: Backend) {
    for pc in [true, false] {
        for seed in 1..=3u64 {
            let (kv, physical) = b.make(400, pc);
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let prefixes = [40, 100, 200, 300]
                .iter()
                .map(|&n| (0..n).map(|_| rng.below(1000) as u32).collect())
                .collect();
            let mut sim = Sim {
                kv,
                physical,
                shadow: vec![0; physical],
                live: BTreeMap::new(),
                g: b.g(),
                prefix_caching: pc,
                rng,
                prefixes,
                next_id: 1,
                failed_allocs: 0,
            };
            for _ in 0..3000 {
                let r = sim.rng.below(100);
                match r {
                    0..=24 if sim.live.len() < 6 => {
                        let t = sim.prompt();
                        let salt = sim.rng.below(2) as u64;
                        let id = sim.next_id;
                        sim.next_id += 1;
                        sim.begin(id, t, salt);
                    }
                    0..=79 => {
                        if let Some(id) = sim.pick() {
                            let done = if r.is_multiple_of(4) {
                                sim.speculate(id)
                            } else {
                                sim.step(id)
                            };
                            if !done {
                                // Out of room: preempt someone, as a scheduler would.
                                let victim = sim.pick().unwrap();
                                sim.release(victim);
                            }
                        }
                    }
                    80..=89 => {
                        if let Some(id) = sim.pick() {
                            sim.release(id);
                        }
                    }
                    90..=94 => {
                        // Restart under the same id (recompute after preemption).
                        if let Some(id) = sim.pick() {
                            let l = sim.live.remove(&id).unwrap();
                            sim.begin(id, l.tokens, l.salt);
                        }
                    }
                    _ => {
                        let before = sim.kv.stats();
                        sim.kv.release(sim.next_id + 1000);
                        assert!(!sim.kv.allocate(sim.next_id + 1000, 5));
                        assert_eq!(sim.kv.stats(), before);
                    }
                }
                sim.verify_all();
            }
            let st = sim.kv.stats();
            assert!(
                sim.failed_allocs > 0,
                "the soak should run out of memory at times"
            );
            if pc {
                assert!(st.prefix_hits > 0 && st.prefix_tokens_reused > 0, "{st:?}");
            } else {
                assert_eq!(st.prefix_hits, 0);
            }
            let ids: Vec<SeqId> = sim.live.keys().copied().collect();
            for id in ids {
                sim.release(id);
                sim.verify_all();
            }
            assert_idle(sim.kv.as_ref());
        }
    }
}

/// Each listed run's full token path (its ancestors' tokens, then its own).
fn run_paths(runs: &[super::CachedRun]) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
    let mut out: Vec<(u64, Vec<u32>, Vec<u32>)> = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let (mut path, mut slots) = match r.parent {
            Some(p) => {
                assert!(p < i, "run {i}'s parent {p} comes after it");
                assert_eq!(runs[p].salt, r.salt, "run {i} changes salt");
                (out[p].1.clone(), out[p].2.clone())
            }
            None => (Vec::new(), Vec::new()),
        };
        assert!(!r.tokens.is_empty() && r.tokens.len() == r.slots.len());
        path.extend_from_slice(&r.tokens);
        slots.extend_from_slice(&r.slots);
        out.push((r.salt, path, slots));
    }
    out
}

fn cached_runs_list_the_cache(b: Backend) {
    let g = b.g();
    let (mut kv, _) = b.make(1024, true);
    let p = distinct_tokens(1, 100);
    let a = cat(&p, &distinct_tokens(2, 37));
    let c = cat(&p, &distinct_tokens(3, 21));
    let q = distinct_tokens(4, 50);
    for (seq, tokens, salt) in [(1, &a, 0), (2, &c, 0), (3, &q, 5)] {
        run_prompt(kv.as_mut(), seq, tokens, salt);
    }
    // Slots as the live sequences map them, before they leave.
    let mapped: Vec<Vec<usize>> = [(1, &a), (2, &c), (3, &q)]
        .iter()
        .map(|&(seq, t)| slots(kv.as_ref(), seq, t.len() / g * g))
        .collect();
    for seq in 1..=3 {
        kv.release(seq);
    }
    let runs = kv.cached_runs();
    let paths = run_paths(&runs);
    let listed: usize = runs.iter().map(|r| r.tokens.len()).sum();
    assert_eq!(
        listed,
        kv.stats().evictable_slots,
        "every cached token, once"
    );
    for (i, (t, salt)) in [(&a, 0), (&c, 0), (&q, 5)].into_iter().enumerate() {
        let full = t.len() / g * g;
        let run = paths
            .iter()
            .find(|(s, path, _)| *s == salt && path[..] == t[..full])
            .unwrap_or_else(|| panic!("prompt {i} ({full} cached tokens) is not listed"));
        let listed_slots: Vec<usize> = run.2.iter().map(|&s| s as usize).collect();
        assert_eq!(listed_slots, mapped[i], "prompt {i}'s slots");
    }
    // Replaying the runs into a fresh cache gives the same cache.
    let (mut fresh, _) = b.make(1024, true);
    for (salt, path, _) in &paths {
        let mut probe = path.clone();
        probe.push(0);
        fresh.begin(99, &probe, *salt);
        assert!(fresh.allocate(99, path.len()));
        fresh.commit(99, path);
        fresh.release(99);
        check(fresh.as_ref());
    }
    let mut again: Vec<_> = run_paths(&fresh.cached_runs())
        .into_iter()
        .map(|(s, p, _)| (s, p))
        .collect();
    let mut want: Vec<_> = paths.into_iter().map(|(s, p, _)| (s, p)).collect();
    again.sort();
    want.sort();
    // Leaves carry the same token paths (a tree may split runs differently).
    let leaves = |v: &[(u64, Vec<u32>)]| -> Vec<(u64, Vec<u32>)> {
        v.iter()
            .filter(|(s, p)| {
                !v.iter()
                    .any(|(s2, p2)| s2 == s && p2.len() > p.len() && p2.starts_with(p))
            })
            .cloned()
            .collect()
    };
    assert_eq!(leaves(&again), leaves(&want));

    let (mut off, _) = b.make(256, false);
    run_prompt(off.as_mut(), 1, &a, 0);
    off.release(1);
    assert!(off.cached_runs().is_empty());
}

macro_rules! suite {
    ($($module:ident => $kind:ident, $bs:expr;)*) => {$(
        mod $module {
            use super::*;
            const B: Backend = Backend { kind: KvBackendKind::$kind, block_size: $bs };
            #[test] fn physical_layout() { super::physical_layout(B) }
            #[test] fn unique_slots_and_mapping() { super::unique_slots_and_mapping(B) }
            #[test] fn allocate_beyond_capacity_changes_nothing() {
                super::allocate_beyond_capacity_changes_nothing(B)
            }
            #[test] fn release_returns_everything() { super::release_returns_everything(B) }
            #[test] fn prefix_reuse() { super::prefix_reuse(B) }
            #[test] fn partial_commits() { super::partial_commits(B) }
            #[test] fn salts_isolate() { super::salts_isolate(B) }
            #[test] fn truncate_frees_rejected_positions() {
                super::truncate_frees_rejected_positions(B)
            }
            #[test] fn lru_eviction() { super::lru_eviction(B) }
            #[test] fn hits_refresh_lru() { super::hits_refresh_lru(B) }
            #[test] fn prefix_caching_off() { super::prefix_caching_off(B) }
            #[test] fn concurrent_duplicate_prefill() { super::concurrent_duplicate_prefill(B) }
            #[test] fn restart_replaces_sequence() { super::restart_replaces_sequence(B) }
            #[test] fn soak() { super::soak(B) }
            #[test] fn cached_runs_list_the_cache() { super::cached_runs_list_the_cache(B) }
        }
    )*};
}

suite! {
    paged_bs1 => Paged, 1;
    paged_bs4 => Paged, 4;
    paged_bs16 => Paged, 16;
    token => Token, 1;
}
