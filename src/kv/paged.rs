//! Paged KV manager (vLLM v1 style): fixed-size blocks, per-sequence block
//! tables, ref-counted blocks and hash-chained prefix reuse of full blocks.

use std::collections::HashMap;

use super::block_pool::BlockPool;
use super::prefix_hash::{block_key, root_key, BlockKey};
use super::{CachedRun, KvBackendKind, KvCacheBackend, KvMapping, KvStats, SeqId};

#[derive(Debug, Default)]
struct PagedSeq {
    table: Vec<u32>,
    /// Chain keys of the leading full blocks whose KV is known to be computed
    /// (matched at `begin` or committed); `keys.len() <= table.len()`.
    keys: Vec<BlockKey>,
    salt: u64,
}

/// Block-table manager over `num_blocks` blocks of `block_size` slots.
/// Block 0 is the null block and is never handed out.
pub struct PagedKv {
    block_size: usize,
    prefix_caching: bool,
    pool: BlockPool,
    seqs: HashMap<SeqId, PagedSeq>,
    /// What each cached block holds, for listing the cache (`cached_runs`):
    /// its tokens (`block_size` per block), its chain parent's key and its
    /// salt. Valid while the pool holds the block under the key it was
    /// cached with. Sized once (empty with prefix caching off), so caching
    /// a block never allocates.
    block_tokens: Vec<u32>,
    block_parent: Vec<BlockKey>,
    block_salt: Vec<u64>,
    prefix_hits: u64,
    prefix_tokens_reused: u64,
}

impl PagedKv {
    /// `num_blocks` includes the null block, so `num_blocks - 1` are usable;
    /// the storage needs `num_blocks * block_size` slots. A zero `block_size`
    /// is treated as 1 and `num_blocks` is at least 1.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        let block_size = block_size.max(1);
        let pool = BlockPool::new(num_blocks);
        let listed = if prefix_caching { pool.num_blocks() } else { 0 };
        PagedKv {
            block_size,
            prefix_caching,
            pool,
            seqs: HashMap::new(),
            block_tokens: vec![0; listed * block_size],
            block_parent: vec![0; listed],
            block_salt: vec![0; listed],
            prefix_hits: 0,
            prefix_tokens_reused: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks including the null block.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Slots the backing `KvStorage` must have.
    pub fn physical_slots(&self) -> usize {
        self.pool.num_blocks() * self.block_size
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The sequence's block table (empty for an unknown sequence).
    pub fn block_table(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.table)
    }
}

impl KvCacheBackend for PagedKv {
    fn kind(&self) -> KvBackendKind {
        KvBackendKind::Paged
    }

    fn begin(&mut self, seq: SeqId, tokens: &[u32], salt: u64) -> usize {
        self.release(seq);
        let mut state = PagedSeq {
            salt,
            ..Default::default()
        };
        if self.prefix_caching && tokens.len() > 1 {
            let bs = self.block_size;
            let mut parent = root_key(salt);
            for block_tokens in tokens[..tokens.len() - 1].chunks_exact(bs) {
                let key = block_key(parent, block_tokens);
                let Some(block) = self.pool.lookup(key) else {
                    break;
                };
                self.pool.touch(block);
                state.table.push(block);
                state.keys.push(key);
                parent = key;
            }
        }
        let cached = state.table.len() * self.block_size;
        if cached > 0 {
            self.prefix_hits += 1;
            self.prefix_tokens_reused += cached as u64;
        }
        self.seqs.insert(seq, state);
        cached
    }

    fn allocate(&mut self, seq: SeqId, total_tokens: usize) -> bool {
        let needed = self.blocks_for(total_tokens);
        let Some(state) = self.seqs.get_mut(&seq) else {
            return false;
        };
        if needed <= state.table.len() {
            return true;
        }
        self.pool
            .allocate(needed - state.table.len(), &mut state.table)
    }

    fn reserve(&mut self, seq: SeqId, max_tokens: usize) {
        let blocks = self.blocks_for(max_tokens);
        if let Some(state) = self.seqs.get_mut(&seq) {
            state
                .table
                .reserve(blocks.saturating_sub(state.table.len()));
            state.keys.reserve(blocks.saturating_sub(state.keys.len()));
        }
    }

    fn commit(&mut self, seq: SeqId, tokens: &[u32]) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let Some(state) = self.seqs.get_mut(&seq) else {
            return;
        };
        let full = tokens.len().min(state.table.len() * bs) / bs;
        for i in state.keys.len()..full {
            let parent = state
                .keys
                .last()
                .copied()
                .unwrap_or_else(|| root_key(state.salt));
            let key = block_key(parent, &tokens[i * bs..(i + 1) * bs]);
            // If another block already holds this key, it stays the cached
            // copy and ours remains private; the chain continues either way.
            let block = state.table[i];
            if self.pool.cache(block, key) {
                let b = block as usize;
                self.block_tokens[b * bs..(b + 1) * bs]
                    .copy_from_slice(&tokens[i * bs..(i + 1) * bs]);
                self.block_parent[b] = parent;
                self.block_salt[b] = state.salt;
            }
            state.keys.push(key);
        }
    }

    fn truncate(&mut self, seq: SeqId, total_tokens: usize) {
        let keep = self.blocks_for(total_tokens);
        let Some(state) = self.seqs.get_mut(&seq) else {
            return;
        };
        // Committed blocks may be shared through the prefix cache.
        let keep = keep.max(state.keys.len());
        while state.table.len() > keep {
            let block = state.table.pop().expect("longer than keep");
            self.pool.free(block);
        }
    }

    fn release(&mut self, seq: SeqId) {
        let Some(state) = self.seqs.remove(&seq) else {
            return;
        };
        // Tail blocks first, so a prefix's last blocks are evicted before its
        // first ones (which other prompts are more likely to share).
        for &block in state.table.iter().rev() {
            self.pool.free(block);
        }
    }

    fn mapping(&self, seq: SeqId) -> KvMapping<'_> {
        KvMapping::Blocks {
            table: self.block_table(seq),
            block_size: self.block_size,
        }
    }

    fn cached_runs(&self) -> Vec<CachedRun> {
        if !self.prefix_caching {
            return Vec::new();
        }
        let bs = self.block_size;
        // Cached blocks by the key of the block they continue.
        let mut children: HashMap<BlockKey, Vec<u32>> = HashMap::new();
        for block in 1..self.pool.num_blocks() as u32 {
            if self.pool.key_of(block).is_some() {
                let parent = self.block_parent[block as usize];
                children.entry(parent).or_default().push(block);
            }
        }
        let mut stack: Vec<(u32, Option<usize>)> = children
            .iter()
            .flat_map(|(&parent, blocks)| blocks.iter().map(move |&b| (parent, b)))
            .filter(|&(parent, b)| parent == root_key(self.block_salt[b as usize]))
            .map(|(_, b)| (b, None))
            .collect();
        stack.sort_unstable_by(|a, b| b.cmp(a));
        let mut runs = Vec::new();
        while let Some((first, parent)) = stack.pop() {
            let mut run = CachedRun {
                parent,
                salt: self.block_salt[first as usize],
                tokens: Vec::new(),
                slots: Vec::new(),
            };
            // A chain of only children is one run.
            let mut block = first;
            let next = loop {
                let b = block as usize;
                run.tokens
                    .extend_from_slice(&self.block_tokens[b * bs..(b + 1) * bs]);
                run.slots.extend((b * bs..(b + 1) * bs).map(|s| s as u32));
                let key = self.pool.key_of(block).expect("listed blocks are cached");
                match children.get(&key).map(Vec::as_slice) {
                    Some(&[only]) => block = only,
                    more => break more.unwrap_or(&[]),
                }
            };
            runs.push(run);
            let index = runs.len() - 1;
            stack.extend(next.iter().rev().map(|&b| (b, Some(index))));
        }
        runs
    }

    fn available_slots(&self) -> usize {
        self.pool.num_available() * self.block_size
    }

    fn stats(&self) -> KvStats {
        let bs = self.block_size;
        let evictable = self.pool.num_evictable();
        KvStats {
            total_slots: self.pool.num_usable() * bs,
            free_slots: (self.pool.num_available() - evictable) * bs,
            evictable_slots: evictable * bs,
            used_slots: self.pool.num_used() * bs,
            granularity: bs,
            prefix_hits: self.prefix_hits,
            prefix_tokens_reused: self.prefix_tokens_reused,
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        let n = self.pool.num_blocks();
        let mut refs = vec![0u32; n];
        for (id, s) in &self.seqs {
            if s.keys.len() > s.table.len() {
                return Err(format!("seq {id} has more block keys than blocks"));
            }
            for &b in &s.table {
                if b as usize >= n || b == super::block_pool::NULL_BLOCK {
                    return Err(format!(
                        "seq {id} maps the null or an out-of-range block {b}"
                    ));
                }
                refs[b as usize] += 1;
            }
            let mut sorted = s.table.clone();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("seq {id} holds the same block twice"));
            }
            // A cached block's key names its contents: it must agree with the
            // chain this sequence computed for that position.
            for (i, &k) in s.keys.iter().enumerate() {
                if let Some(bk) = self.pool.key_of(s.table[i]) {
                    if bk != k {
                        return Err(format!(
                            "seq {id} block {i} holds different cached contents"
                        ));
                    }
                }
            }
            if !self.prefix_caching && !s.keys.is_empty() {
                return Err(format!("seq {id} has cache keys with prefix caching off"));
            }
        }
        self.pool.check(&refs)?;
        let st = self.stats();
        if st.free_slots + st.evictable_slots + st.used_slots != st.total_slots {
            return Err(format!("free + evictable + used != total: {st:?}"));
        }
        if !self.prefix_caching && st.evictable_slots != 0 {
            return Err("cached blocks exist with prefix caching off".into());
        }
        Ok(())
    }
}
