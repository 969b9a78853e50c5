//! Token-pool KV manager (SGLang style): page size 1, a free-slot stack
//! (TokenToKVPoolAllocator), a per-sequence slot list (ReqToTokenPool) and a
//! radix-tree prefix cache (RadixCache).
//!
//! A sequence's slot list is split at `tree_len`: the first part is owned by
//! the radix tree (shared, pinned by the sequence's lock on `node`), the rest
//! is private to the sequence until `commit` hands it to the tree.

use std::collections::HashMap;

use super::radix::{NodeId, RadixTree};
use super::{CachedRun, KvBackendKind, KvCacheBackend, KvMapping, KvStats, SeqId};

/// Slot 0 is the dummy slot and is never handed out.
pub const DUMMY_SLOT: u32 = 0;

#[derive(Debug, Default)]
struct TokenSeq {
    slots: Vec<u32>,
    /// Leading slots owned by the tree (the path from the root to `node`).
    tree_len: usize,
    /// Deepest tree node this sequence locks; None when `tree_len == 0`.
    node: Option<NodeId>,
    salt: u64,
}

pub struct TokenKv {
    num_slots: usize,
    free: Vec<u32>,
    seqs: HashMap<SeqId, TokenSeq>,
    /// None when prefix caching is off.
    tree: Option<RadixTree>,
    /// Slots held by sequences outside the tree.
    private: usize,
    prefix_hits: u64,
    prefix_tokens_reused: u64,
}

impl TokenKv {
    /// `num_slots` usable slots; the storage needs `num_slots + 1` (slot 0 is the dummy).
    pub fn new(num_slots: usize, prefix_caching: bool) -> Self {
        let num_slots = num_slots.min(u32::MAX as usize - 1);
        TokenKv {
            num_slots,
            // Reversed so that pops hand out low slot ids first.
            free: (1..=num_slots as u32).rev().collect(),
            seqs: HashMap::new(),
            tree: prefix_caching.then(RadixTree::new),
            private: 0,
            prefix_hits: 0,
            prefix_tokens_reused: 0,
        }
    }

    /// Slots the backing `KvStorage` must have.
    pub fn physical_slots(&self) -> usize {
        self.num_slots + 1
    }

    /// The sequence's slot list (empty for an unknown sequence).
    pub fn slots(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.slots)
    }
}

impl KvCacheBackend for TokenKv {
    fn kind(&self) -> KvBackendKind {
        KvBackendKind::Token
    }

    fn begin(&mut self, seq: SeqId, tokens: &[u32], salt: u64) -> usize {
        self.release(seq);
        let mut state = TokenSeq {
            salt,
            ..Default::default()
        };
        if let (Some(tree), true) = (self.tree.as_mut(), tokens.len() > 1) {
            state.node = tree.match_prefix(salt, &tokens[..tokens.len() - 1], &mut state.slots);
            if let Some(n) = state.node {
                tree.lock(n);
            }
            state.tree_len = state.slots.len();
        }
        let cached = state.tree_len;
        if cached > 0 {
            self.prefix_hits += 1;
            self.prefix_tokens_reused += cached as u64;
        }
        self.seqs.insert(seq, state);
        cached
    }

    fn allocate(&mut self, seq: SeqId, total_tokens: usize) -> bool {
        let Some(state) = self.seqs.get_mut(&seq) else {
            return false;
        };
        let Some(needed) = total_tokens
            .checked_sub(state.slots.len())
            .filter(|&n| n > 0)
        else {
            return true;
        };
        let evictable = self.tree.as_ref().map_or(0, |t| t.evictable_size());
        if needed > self.free.len() + evictable {
            return false;
        }
        if needed > self.free.len() {
            let short = needed - self.free.len();
            if let Some(tree) = self.tree.as_mut() {
                tree.evict(short, &mut self.free);
            }
        }
        let start = self.free.len() - needed;
        state.slots.extend(self.free.drain(start..).rev());
        self.private += needed;
        true
    }

    fn reserve(&mut self, seq: SeqId, max_tokens: usize) {
        if let Some(state) = self.seqs.get_mut(&seq) {
            state
                .slots
                .reserve(max_tokens.saturating_sub(state.slots.len()));
        }
    }

    fn commit(&mut self, seq: SeqId, tokens: &[u32]) {
        let Some(tree) = self.tree.as_mut() else {
            return;
        };
        let Some(state) = self.seqs.get_mut(&seq) else {
            return;
        };
        let n = tokens.len().min(state.slots.len());
        if n <= state.tree_len {
            return;
        }
        let from = state.tree_len;
        if let Some(node) = state.node {
            if tree.extend_leaf(node, &tokens[from..n], &state.slots[from..n]) {
                self.private -= n - from;
                state.tree_len = n;
                return;
            }
        }
        // Slots the tree already had for these tokens replace ours; ours go
        // straight back to the free stack.
        let deepest = tree.insert(
            state.salt,
            state.node,
            &tokens[from..n],
            &mut state.slots[from..n],
            &mut self.free,
        );
        self.private -= n - from;
        state.tree_len = n;
        if deepest != state.node {
            if let Some(d) = deepest {
                tree.lock(d);
            }
            if let Some(old) = state.node {
                tree.unlock(old);
            }
            state.node = deepest;
        }
    }

    fn truncate(&mut self, seq: SeqId, total_tokens: usize) {
        let Some(state) = self.seqs.get_mut(&seq) else {
            return;
        };
        // Slots below `tree_len` belong to the prefix cache.
        let keep = total_tokens.max(state.tree_len);
        if state.slots.len() > keep {
            self.private -= state.slots.len() - keep;
            self.free.extend(state.slots.drain(keep..).rev());
        }
    }

    fn release(&mut self, seq: SeqId) {
        let Some(state) = self.seqs.remove(&seq) else {
            return;
        };
        if let (Some(tree), Some(node)) = (self.tree.as_mut(), state.node) {
            tree.unlock(node);
        }
        let private = &state.slots[state.tree_len..];
        self.private -= private.len();
        self.free.extend_from_slice(private);
    }

    fn mapping(&self, seq: SeqId) -> KvMapping<'_> {
        KvMapping::Slots(self.slots(seq))
    }

    fn cached_runs(&self) -> Vec<CachedRun> {
        self.tree.as_ref().map_or_else(Vec::new, RadixTree::runs)
    }

    fn available_slots(&self) -> usize {
        self.free.len() + self.tree.as_ref().map_or(0, |t| t.evictable_size())
    }

    fn stats(&self) -> KvStats {
        let (evictable, protected) = self
            .tree
            .as_ref()
            .map_or((0, 0), |t| (t.evictable_size(), t.protected_size()));
        KvStats {
            total_slots: self.num_slots,
            free_slots: self.free.len(),
            evictable_slots: evictable,
            used_slots: self.private + protected,
            granularity: 1,
            prefix_hits: self.prefix_hits,
            prefix_tokens_reused: self.prefix_tokens_reused,
        }
    }

    fn check_invariants(&self) -> Result<(), String> {
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Owner {
            None,
            Free,
            Tree,
            Seq(SeqId),
        }
        let mut owner = vec![Owner::None; self.num_slots + 1];
        let mut claim = |slot: u32, who: Owner| -> Result<(), String> {
            match owner.get_mut(slot as usize) {
                _ if slot == DUMMY_SLOT => Err(format!("dummy slot 0 is held by {who:?}")),
                None => Err(format!("slot {slot} is out of range (held by {who:?})")),
                Some(o) if *o != Owner::None => {
                    Err(format!("slot {slot} is held by {o:?} and {who:?}"))
                }
                Some(o) => {
                    *o = who;
                    Ok(())
                }
            }
        };
        for &s in &self.free {
            claim(s, Owner::Free)?;
        }
        let mut tree_err = Ok(());
        if let Some(tree) = &self.tree {
            tree.for_each_slot(|s| {
                if tree_err.is_ok() {
                    tree_err = claim(s, Owner::Tree);
                }
            });
        }
        tree_err?;
        let mut private = 0;
        let mut holders = Vec::new();
        for (&id, s) in &self.seqs {
            for &slot in &s.slots[s.tree_len..] {
                claim(slot, Owner::Seq(id))?;
            }
            private += s.slots.len() - s.tree_len;
            match (&self.tree, s.node) {
                (Some(tree), Some(node)) => {
                    if !tree.is_live(node) || tree.lock_ref(node) == 0 {
                        return Err(format!("seq {id} points at a dead or unlocked tree node"));
                    }
                    if tree.path_slots(node) != s.slots[..s.tree_len] {
                        return Err(format!("seq {id} prefix slots differ from its tree path"));
                    }
                    holders.push(node);
                }
                (_, None) if s.tree_len == 0 => {}
                _ => {
                    return Err(format!(
                        "seq {id} claims {} tree slots without a node",
                        s.tree_len
                    ))
                }
            }
        }
        if let Some(slot) = (1..owner.len()).find(|&s| owner[s] == Owner::None) {
            return Err(format!(
                "slot {slot} is leaked (neither free, cached nor held)"
            ));
        }
        if private != self.private {
            return Err(format!(
                "private counter {} but sequences hold {private}",
                self.private
            ));
        }
        if let Some(tree) = &self.tree {
            tree.check(&holders)?;
        }
        let st = self.stats();
        if st.free_slots + st.evictable_slots + st.used_slots != st.total_slots {
            return Err(format!("free + evictable + used != total: {st:?}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_commits_extend_the_leaf_instead_of_adding_nodes() {
        let mut kv = TokenKv::new(256, true);
        let mut toks: Vec<u32> = (0..20).collect();
        kv.begin(1, &toks, 0);
        assert!(kv.allocate(1, 20));
        kv.commit(1, &toks);
        for t in 100..150 {
            toks.push(t);
            assert!(kv.allocate(1, toks.len()));
            kv.commit(1, &toks);
            kv.check_invariants().unwrap();
        }
        let tree = kv.tree.as_ref().unwrap();
        assert_eq!(tree.num_nodes(), 2, "one root and one leaf");
        assert_eq!(tree.protected_size(), 70);
        // A second sequence matching 69 tokens splits the leaf; seq 1 alone
        // holds the lower part, so it keeps extending that in place.
        assert_eq!(kv.begin(2, &toks, 0), 69);
        toks.push(7);
        assert!(kv.allocate(1, toks.len()));
        kv.commit(1, &toks);
        kv.check_invariants().unwrap();
        let nodes = kv.tree.as_ref().unwrap().num_nodes();
        assert_eq!(nodes, 3, "root, shared upper part, seq 1's lower part");
        // Seq 2 then diverges: its tokens go into a new leaf under the shared part.
        let mut other = toks[..69].to_vec();
        other.push(999);
        assert!(kv.allocate(2, 70));
        kv.commit(2, &other);
        kv.check_invariants().unwrap();
        assert_eq!(kv.tree.as_ref().unwrap().num_nodes(), 4);
        assert_eq!(kv.slots(1)[..69], kv.slots(2)[..69]);
    }
}
