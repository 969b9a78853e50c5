//! Block pool for the paged manager: per-block ref counts, the free queue and
//! the key → block map of the prefix cache (vLLM v1 `BlockPool` design).
//!
//! Every block with ref count 0 (except the null block 0) sits in one free
//! queue. Blocks holding no cached data are kept at the head, cached ones are
//! appended at the tail when released, so popping from the head hands out
//! empty blocks first and then evicts the least recently released cached block.
//! A cached block hit again is unlinked from the middle of the queue in O(1).

use std::collections::HashMap;

use super::prefix_hash::{BlockKey, KeyBuild};

/// Block id reserved as the null block; never handed out.
pub const NULL_BLOCK: u32 = 0;

/// Doubly linked list over block ids, stored in two index arrays.
/// Index `capacity` is the sentinel, so head = `next[s]`, tail = `prev[s]`.
#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    len: usize,
}

impl FreeBlockQueue {
    /// An empty queue able to hold block ids `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        let s = capacity as u32;
        FreeBlockQueue {
            prev: vec![s; capacity + 1],
            next: vec![s; capacity + 1],
            in_queue: vec![false; capacity],
            len: 0,
        }
    }

    #[inline]
    fn sentinel(&self) -> u32 {
        self.in_queue.len() as u32
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub fn contains(&self, block: u32) -> bool {
        self.in_queue.get(block as usize).copied().unwrap_or(false)
    }

    fn link_after(&mut self, at: u32, block: u32) {
        debug_assert!(!self.in_queue[block as usize]);
        let after = self.next[at as usize];
        self.prev[block as usize] = at;
        self.next[block as usize] = after;
        self.next[at as usize] = block;
        self.prev[after as usize] = block;
        self.in_queue[block as usize] = true;
        self.len += 1;
    }

    /// Appends at the tail (evicted last). Returns false if already queued.
    pub fn push_back(&mut self, block: u32) -> bool {
        if self.contains(block) || block >= self.sentinel() {
            return false;
        }
        let tail = self.prev[self.sentinel() as usize];
        self.link_after(tail, block);
        true
    }

    /// Inserts at the head (handed out first). Returns false if already queued.
    pub fn push_front(&mut self, block: u32) -> bool {
        if self.contains(block) || block >= self.sentinel() {
            return false;
        }
        self.link_after(self.sentinel(), block);
        true
    }

    /// Unlinks `block` wherever it is. Returns false if it was not queued.
    pub fn remove(&mut self, block: u32) -> bool {
        if !self.contains(block) {
            return false;
        }
        let (p, n) = (self.prev[block as usize], self.next[block as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.in_queue[block as usize] = false;
        self.len -= 1;
        true
    }

    pub fn front(&self) -> Option<u32> {
        let head = self.next[self.sentinel() as usize];
        (head != self.sentinel()).then_some(head)
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        let head = self.front()?;
        self.remove(head);
        Some(head)
    }

    /// Blocks from head to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let s = self.sentinel();
        let mut cur = self.next[s as usize];
        // Bounded by len + 1 so a corrupted list cannot loop forever.
        (0..=self.len).map_while(move |_| {
            (cur != s).then(|| {
                let b = cur;
                cur = self.next[b as usize];
                b
            })
        })
    }

    /// Structural check: links agree both ways, no repeats, length and flags match.
    pub fn check(&self) -> Result<(), String> {
        let s = self.sentinel();
        let mut seen = vec![false; self.in_queue.len()];
        let mut count = 0usize;
        let mut prev = s;
        let mut cur = self.next[s as usize];
        while cur != s {
            let b = cur as usize;
            if b >= seen.len() {
                return Err(format!("free queue links to out-of-range block {b}"));
            }
            if seen[b] {
                return Err(format!("block {b} appears twice in the free queue"));
            }
            seen[b] = true;
            if self.prev[b] != prev {
                return Err(format!("free queue back link of block {b} is broken"));
            }
            if !self.in_queue[b] {
                return Err(format!("block {b} is linked but not flagged as queued"));
            }
            count += 1;
            prev = cur;
            cur = self.next[b];
        }
        if self.prev[s as usize] != prev {
            return Err("free queue tail pointer is stale".into());
        }
        if count != self.len {
            return Err(format!(
                "free queue holds {count} blocks but len is {}",
                self.len
            ));
        }
        if let Some(b) = (0..seen.len()).find(|&b| self.in_queue[b] && !seen[b]) {
            return Err(format!("block {b} is flagged as queued but not linked"));
        }
        Ok(())
    }
}

/// Ref counts, cache keys and the free queue for `num_blocks` blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    key: Vec<Option<BlockKey>>,
    cached: HashMap<BlockKey, u32, KeyBuild>,
    queue: FreeBlockQueue,
    num_evictable: usize,
    num_used: usize,
}

impl BlockPool {
    /// All blocks but the null block start free.
    pub fn new(num_blocks: usize) -> Self {
        let num_blocks = num_blocks.clamp(1, u32::MAX as usize - 1);
        let mut queue = FreeBlockQueue::new(num_blocks);
        for b in 1..num_blocks as u32 {
            queue.push_back(b);
        }
        BlockPool {
            ref_cnt: vec![0; num_blocks],
            key: vec![None; num_blocks],
            // At most one key per block; twice that keeps the table from
            // growing (tombstones are rehashed in place at under half load),
            // so caching blocks never allocates.
            cached: HashMap::with_capacity_and_hasher(2 * num_blocks, KeyBuild),
            queue,
            num_evictable: 0,
            num_used: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks that can ever be handed out (all but the null block).
    pub fn num_usable(&self) -> usize {
        self.ref_cnt.len() - 1
    }

    /// Blocks `allocate` can obtain: empty plus evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.queue.len()
    }

    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    pub fn num_used(&self) -> usize {
        self.num_used
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_cnt.get(block as usize).copied().unwrap_or(0)
    }

    pub fn key_of(&self, block: u32) -> Option<BlockKey> {
        self.key.get(block as usize).copied().flatten()
    }

    /// The cached block holding `key`, if any (referenced or evictable).
    pub fn lookup(&self, key: BlockKey) -> Option<u32> {
        self.cached.get(&key).copied()
    }

    /// Takes one more reference on an existing block (a prefix-cache hit);
    /// an unreferenced block leaves the free queue.
    pub fn touch(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_cnt[b] == 0 {
            self.queue.remove(block);
            self.num_used += 1;
            if self.key[b].is_some() {
                self.num_evictable -= 1;
            }
        }
        self.ref_cnt[b] += 1;
    }

    /// Pops `n` blocks (ref count 1 each) onto `out`, evicting cached ones as
    /// needed. Returns false and changes nothing when fewer than `n` are available.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.queue.len() {
            return false;
        }
        out.reserve(n);
        for _ in 0..n {
            let Some(b) = self.queue.pop_front() else {
                unreachable!("free queue shorter than its length")
            };
            if let Some(k) = self.key[b as usize].take() {
                self.cached.remove(&k);
                self.num_evictable -= 1;
            }
            self.ref_cnt[b as usize] = 1;
            self.num_used += 1;
            out.push(b);
        }
        true
    }

    /// Drops one reference. At zero the block joins the free queue: cached
    /// blocks at the tail (most recently used), empty ones at the head.
    pub fn free(&mut self, block: u32) {
        let b = block as usize;
        if block == NULL_BLOCK || b >= self.ref_cnt.len() || self.ref_cnt[b] == 0 {
            debug_assert!(false, "freeing block {block} which holds no reference");
            return;
        }
        self.ref_cnt[b] -= 1;
        if self.ref_cnt[b] == 0 {
            self.num_used -= 1;
            if self.key[b].is_some() {
                self.num_evictable += 1;
                self.queue.push_back(block);
            } else {
                self.queue.push_front(block);
            }
        }
    }

    /// Registers a referenced, full block under `key`. Does nothing (returns
    /// false) if another block already holds that key or the block is cached.
    pub fn cache(&mut self, block: u32, key: BlockKey) -> bool {
        let b = block as usize;
        if self.ref_cnt[b] == 0 || self.key[b].is_some() || self.cached.contains_key(&key) {
            return false;
        }
        self.cached.insert(key, block);
        self.key[b] = Some(key);
        true
    }

    /// Pool-internal consistency. `expected_refs[b]` is the number of live
    /// references to block `b` as counted by the caller from its tables.
    pub fn check(&self, expected_refs: &[u32]) -> Result<(), String> {
        self.queue.check()?;
        if expected_refs.len() != self.ref_cnt.len() {
            return Err("reference tally has the wrong length".into());
        }
        if self.ref_cnt[0] != 0 || self.queue.contains(NULL_BLOCK) || self.key[0].is_some() {
            return Err("the null block is referenced, queued or cached".into());
        }
        let (mut used, mut evictable) = (0, 0);
        let tallies = self.ref_cnt.iter().zip(expected_refs).enumerate().skip(1);
        for (b, (&refs, &tally)) in tallies {
            if refs != tally {
                return Err(format!(
                    "block {b} has ref count {refs} but {tally} table entries"
                ));
            }
            let queued = self.queue.contains(b as u32);
            if (refs == 0) != queued {
                return Err(format!(
                    "block {b} has ref count {refs} but queued={queued}"
                ));
            }
            if refs > 0 {
                used += 1;
            } else if self.key[b].is_some() {
                evictable += 1;
            }
            if let Some(k) = self.key[b] {
                if self.cached.get(&k) != Some(&(b as u32)) {
                    return Err(format!(
                        "block {b} has a key the cache map does not point back to"
                    ));
                }
            }
        }
        if self.cached.len() != self.key.iter().flatten().count() {
            return Err("cache map has entries for blocks that hold no key".into());
        }
        if used != self.num_used || evictable != self.num_evictable {
            return Err(format!(
                "counters say used={} evictable={}, actual used={used} evictable={evictable}",
                self.num_used, self.num_evictable
            ));
        }
        if used + self.queue.len() != self.num_usable() {
            return Err("used + queued blocks do not add up to the usable blocks".into());
        }
        // Empty blocks must all come before cached ones, or eviction would
        // throw away cached data while empty blocks are still available.
        let mut seen_cached = false;
        for b in self.queue.iter() {
            let is_cached = self.key[b as usize].is_some();
            if seen_cached && !is_cached {
                return Err(format!("empty block {b} is queued behind a cached block"));
            }
            seen_cached |= is_cached;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(q: &FreeBlockQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn queue_push_pop_and_middle_removal() {
        let mut q = FreeBlockQueue::new(8);
        assert!(q.is_empty() && q.pop_front().is_none());
        for b in [3, 5, 7] {
            assert!(q.push_back(b));
        }
        assert!(q.push_front(1));
        assert_eq!(contents(&q), vec![1, 3, 5, 7]);
        assert!(!q.push_back(5), "a queued block must not be queued twice");
        assert!(q.remove(5));
        assert!(!q.remove(5), "removing twice must be refused");
        assert_eq!(contents(&q), vec![1, 3, 7]);
        assert!(q.remove(7), "tail removal");
        assert!(q.remove(1), "head removal");
        assert_eq!(contents(&q), vec![3]);
        assert_eq!(q.pop_front(), Some(3));
        assert_eq!(q.len(), 0);
        q.check().unwrap();
        assert!(!q.push_back(8), "out-of-range ids are refused");
    }

    #[test]
    fn queue_random_ops_match_a_vecdeque_model() {
        let mut q = FreeBlockQueue::new(32);
        let mut model: std::collections::VecDeque<u32> = Default::default();
        let mut x = 0x1234_5678_u64;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = (x % 32) as u32;
            match (x >> 8) % 4 {
                0 => {
                    let ok = !model.contains(&b);
                    assert_eq!(q.push_back(b), ok);
                    if ok {
                        model.push_back(b);
                    }
                }
                1 => {
                    let ok = !model.contains(&b);
                    assert_eq!(q.push_front(b), ok);
                    if ok {
                        model.push_front(b);
                    }
                }
                2 => {
                    let pos = model.iter().position(|&m| m == b);
                    assert_eq!(q.remove(b), pos.is_some());
                    if let Some(p) = pos {
                        model.remove(p);
                    }
                }
                _ => assert_eq!(q.pop_front(), model.pop_front()),
            }
            q.check().unwrap();
            assert_eq!(contents(&q), model.iter().copied().collect::<Vec<_>>());
        }
    }

    #[test]
    fn pool_hands_out_empty_blocks_before_evicting_lru_cached_ones() {
        let mut pool = BlockPool::new(6); // usable blocks 1..=5
        let mut a = Vec::new();
        assert!(pool.allocate(2, &mut a));
        let mut b = Vec::new();
        assert!(pool.allocate(2, &mut b));
        assert_eq!(pool.num_available(), 1);
        assert!(pool.cache(a[0], 10) && pool.cache(a[1], 11));
        assert!(pool.cache(b[0], 20));
        assert!(!pool.cache(b[1], 20), "a key must not be registered twice");
        assert!(!pool.cache(a[0], 12), "a cached block must not be re-keyed");
        // Release a, then b: a's cached blocks are older.
        for &blk in a.iter().rev() {
            pool.free(blk);
        }
        for &blk in b.iter().rev() {
            pool.free(blk);
        }
        let n: Vec<u32> = (0..pool.num_blocks() as u32)
            .map(|x| pool.ref_count(x))
            .collect();
        pool.check(&n).unwrap();
        assert_eq!(pool.num_evictable(), 3);
        assert_eq!(pool.num_available(), 5);
        // Two empty blocks go first, then a's last block, then a's first.
        let mut got = Vec::new();
        assert!(pool.allocate(3, &mut got));
        assert!(!got.contains(&a[0]) && !got.contains(&b[0]));
        assert!(
            got.contains(&a[1]),
            "the least recently released cached block is evicted"
        );
        assert_eq!(pool.lookup(11), None);
        assert_eq!(pool.lookup(10), Some(a[0]));
        // A hit on b[0] takes it out of the middle of the queue.
        pool.touch(b[0]);
        assert_eq!(pool.ref_count(b[0]), 1);
        assert_eq!(pool.num_evictable(), 1);
        let mut last = Vec::new();
        assert!(pool.allocate(1, &mut last));
        assert_eq!(last, vec![a[0]]);
        assert!(!pool.allocate(1, &mut last), "pool is exhausted");
        assert_eq!(last.len(), 1, "a failed allocation changes nothing");
        let mut refs = vec![0u32; pool.num_blocks()];
        for &blk in got.iter().chain(&last).chain(&[b[0]]) {
            refs[blk as usize] += 1;
        }
        pool.check(&refs).unwrap();
    }
}
