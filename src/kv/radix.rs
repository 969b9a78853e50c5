//! Radix tree over token ids mapping cached prefixes to KV slots (SGLang
//! `RadixCache` design), one tree per salt.
//!
//! Each node holds a run of tokens and the slots holding their KV. A lock on
//! a node pins it and all its ancestors; unlocked leaves are evictable in
//! least-recently-used order (kept in an ordered set, so eviction never scans
//! the tree). Eviction trims a leaf from its end, so evicting fewer tokens
//! than a leaf holds keeps the leaf's beginning cached.

use std::collections::{BTreeSet, HashMap};

/// Index of a node in the tree's arena.
pub type NodeId = u32;

const NIL: NodeId = NodeId::MAX;

#[derive(Debug, Default)]
struct Node {
    /// `NIL` for a salt's root (which holds no tokens and is never locked).
    parent: NodeId,
    children: HashMap<u32, NodeId>,
    key: Vec<u32>,
    slots: Vec<u32>,
    lock_ref: u32,
    last_access: u64,
    /// `Some(t)` iff the node is in `RadixTree::leaves` as `(t, id)`.
    leaf_tick: Option<u64>,
    salt: u64,
    alive: bool,
}

impl Node {
    fn is_root(&self) -> bool {
        self.parent == NIL
    }
}

#[derive(Debug, Default)]
pub struct RadixTree {
    nodes: Vec<Node>,
    free_ids: Vec<NodeId>,
    roots: HashMap<u64, NodeId>,
    /// Unlocked non-root leaves by (last access, id): the eviction order.
    leaves: BTreeSet<(u64, NodeId)>,
    clock: u64,
    evictable: usize,
    protected: usize,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixTree {
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached tokens nobody holds a lock on.
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Cached tokens pinned by at least one lock.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    pub fn total_size(&self) -> usize {
        self.evictable + self.protected
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        let node = Node {
            alive: true,
            ..node
        };
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    fn drop_node(&mut self, id: NodeId) {
        self.nodes[id as usize] = Node::default();
        self.free_ids.push(id);
    }

    fn root_for(&mut self, salt: u64) -> NodeId {
        if let Some(&r) = self.roots.get(&salt) {
            return r;
        }
        let r = self.new_node(Node {
            parent: NIL,
            salt,
            ..Default::default()
        });
        self.roots.insert(salt, r);
        r
    }

    /// Puts the node in or out of the eviction set to match its state.
    fn refresh_leaf(&mut self, id: NodeId) {
        let n = self.node(id);
        let want = !n.is_root() && n.children.is_empty() && n.lock_ref == 0;
        let (tick, current) = (n.last_access, n.leaf_tick);
        if want && current == Some(tick) {
            return;
        }
        if let Some(t) = current {
            self.leaves.remove(&(t, id));
        }
        let new_tick = want.then_some(tick);
        if want {
            self.leaves.insert((tick, id));
        }
        self.node_mut(id).leaf_tick = new_tick;
    }

    fn touch(&mut self, id: NodeId, now: u64) {
        self.node_mut(id).last_access = now;
        self.refresh_leaf(id);
    }

    /// Splits `child` after its first `k` tokens; returns the new upper node.
    /// `child` keeps its id (and children) and becomes the lower part, so
    /// handles on it keep meaning "the same prefix end".
    fn split(&mut self, child: NodeId, k: usize) -> NodeId {
        let c = self.node_mut(child);
        debug_assert!(k > 0 && k < c.key.len());
        let key: Vec<u32> = c.key.drain(..k).collect();
        let slots: Vec<u32> = c.slots.drain(..k).collect();
        let (parent, lock_ref, last_access, salt, lower_first) =
            (c.parent, c.lock_ref, c.last_access, c.salt, c.key[0]);
        let first = key[0];
        let upper = self.new_node(Node {
            parent,
            children: HashMap::from([(lower_first, child)]),
            key,
            slots,
            lock_ref,
            last_access,
            salt,
            ..Default::default()
        });
        self.node_mut(child).parent = upper;
        self.node_mut(parent).children.insert(first, upper);
        upper
    }

    /// Longest cached prefix of `tokens` under `salt`. Appends its slots to
    /// `out` and returns the node where it ends (None if nothing matched).
    /// Splits a node when the match ends inside it.
    pub fn match_prefix(
        &mut self,
        salt: u64,
        tokens: &[u32],
        out: &mut Vec<u32>,
    ) -> Option<NodeId> {
        self.clock += 1;
        let now = self.clock;
        let mut node = *self.roots.get(&salt)?;
        let mut deepest = None;
        let mut i = 0;
        while i < tokens.len() {
            let Some(&child) = self.node(node).children.get(&tokens[i]) else {
                break;
            };
            let len = self.node(child).key.len();
            let k = common_prefix(&self.node(child).key, &tokens[i..]);
            let hit = if k < len { self.split(child, k) } else { child };
            out.extend_from_slice(&self.node(hit).slots);
            self.touch(hit, now);
            deepest = Some(hit);
            node = hit;
            i += k;
            if k < len {
                break;
            }
        }
        deepest
    }

    /// Inserts `tokens` (with KV in `slots`) below `from` (None: the salt's
    /// root), so the inserted run starts right after `from`'s prefix. Where
    /// the tree already caches a token, the tree's slot wins: the caller's
    /// slot is appended to `duplicates` (to be freed) and replaced in `slots`.
    /// Returns the node where the inserted prefix ends (`from` if empty).
    pub fn insert(
        &mut self,
        salt: u64,
        from: Option<NodeId>,
        tokens: &[u32],
        slots: &mut [u32],
        duplicates: &mut Vec<u32>,
    ) -> Option<NodeId> {
        let len = tokens.len().min(slots.len());
        if len == 0 {
            return from;
        }
        self.clock += 1;
        let now = self.clock;
        let mut node = match from {
            Some(n) => n,
            None => self.root_for(salt),
        };
        let salt = self.node(node).salt;
        let mut i = 0;
        while i < len {
            let Some(&child) = self.node(node).children.get(&tokens[i]) else {
                let leaf = self.new_node(Node {
                    parent: node,
                    key: tokens[i..len].to_vec(),
                    slots: slots[i..len].to_vec(),
                    last_access: now,
                    salt,
                    ..Default::default()
                });
                self.evictable += len - i;
                self.node_mut(node).children.insert(tokens[i], leaf);
                if !self.node(node).is_root() {
                    self.refresh_leaf(node);
                }
                self.refresh_leaf(leaf);
                return Some(leaf);
            };
            let clen = self.node(child).key.len();
            let k = common_prefix(&self.node(child).key, &tokens[i..len]);
            let hit = if k < clen {
                self.split(child, k)
            } else {
                child
            };
            for (mine, &cached) in slots[i..i + k]
                .iter_mut()
                .zip(&self.nodes[hit as usize].slots)
            {
                if *mine != cached {
                    duplicates.push(*mine);
                    *mine = cached;
                }
            }
            self.touch(hit, now);
            node = hit;
            i += k;
        }
        Some(node)
    }

    /// Appends `tokens`/`slots` to `node` in place when `node` is a leaf
    /// whose only lock is the caller's, so decoding one token at a time does
    /// not grow the tree by one node per token. Returns false (and changes
    /// nothing) when that does not hold; the caller then uses `insert`.
    pub fn extend_leaf(&mut self, node: NodeId, tokens: &[u32], slots: &[u32]) -> bool {
        let Some(nd) = self.nodes.get_mut(node as usize) else {
            return false;
        };
        if !nd.alive || nd.is_root() || !nd.children.is_empty() || nd.lock_ref != 1 {
            return false;
        }
        let len = tokens.len().min(slots.len());
        nd.key.extend_from_slice(&tokens[..len]);
        nd.slots.extend_from_slice(&slots[..len]);
        self.protected += len;
        true
    }

    /// Live nodes, salt roots included.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_ids.len()
    }

    /// Pins `node` and its ancestors against eviction.
    pub fn lock(&mut self, node: NodeId) {
        let mut n = node;
        while !self.node(n).is_root() {
            let nd = self.node_mut(n);
            if nd.lock_ref == 0 {
                let len = nd.key.len();
                self.evictable -= len;
                self.protected += len;
            }
            self.node_mut(n).lock_ref += 1;
            self.refresh_leaf(n);
            n = self.node(n).parent;
        }
    }

    /// Undoes one `lock(node)`; marks the path as just used.
    pub fn unlock(&mut self, node: NodeId) {
        self.clock += 1;
        let now = self.clock;
        let mut n = node;
        while !self.node(n).is_root() {
            let nd = self.node_mut(n);
            if nd.lock_ref == 0 {
                debug_assert!(false, "unlocking an unlocked radix node");
                return;
            }
            nd.lock_ref -= 1;
            nd.last_access = now;
            if nd.lock_ref == 0 {
                let len = nd.key.len();
                self.evictable += len;
                self.protected -= len;
            }
            self.refresh_leaf(n);
            n = self.node(n).parent;
        }
    }

    /// Frees at least `num` cached tokens (fewer if not enough are
    /// evictable), least recently used leaves first; freed slots are
    /// appended to `freed`. Returns the number of tokens freed.
    pub fn evict(&mut self, num: usize, freed: &mut Vec<u32>) -> usize {
        let mut done = 0;
        while done < num {
            let Some(&(tick, id)) = self.leaves.first() else {
                break;
            };
            let want = num - done;
            let len = self.node(id).slots.len();
            if want < len {
                let keep = len - want;
                let nd = self.node_mut(id);
                freed.extend(nd.slots.drain(keep..));
                nd.key.truncate(keep);
                self.evictable -= want;
                done += want;
                continue;
            }
            self.leaves.remove(&(tick, id));
            let nd = self.node_mut(id);
            freed.append(&mut nd.slots);
            let (parent, first) = (nd.parent, nd.key[0]);
            self.evictable -= len;
            done += len;
            self.drop_node(id);
            let p = self.node_mut(parent);
            p.children.remove(&first);
            if p.is_root() {
                if p.children.is_empty() {
                    let salt = p.salt;
                    self.roots.remove(&salt);
                    self.drop_node(parent);
                }
            } else {
                self.refresh_leaf(parent);
            }
        }
        done
    }

    /// Slots along the path from the root to `node`, in token order.
    pub fn path_slots(&self, node: NodeId) -> Vec<u32> {
        let mut parts = Vec::new();
        let mut n = node;
        while (n as usize) < self.nodes.len() && !self.node(n).is_root() {
            parts.push(n);
            n = self.node(n).parent;
        }
        parts
            .iter()
            .rev()
            .flat_map(|&p| self.node(p).slots.iter().copied())
            .collect()
    }

    /// Every cached run, parents before children (see
    /// `KvCacheBackend::cached_runs`): a node is a run, its parent node's
    /// run its parent. Salts in ascending order, children by first token.
    pub fn runs(&self) -> Vec<super::CachedRun> {
        let mut salts: Vec<(&u64, &NodeId)> = self.roots.iter().collect();
        salts.sort_unstable();
        let mut runs = Vec::new();
        let mut stack: Vec<(NodeId, Option<usize>)> = Vec::new();
        let push_children = |stack: &mut Vec<(NodeId, Option<usize>)>, node: &Node, run| {
            let mut kids: Vec<(&u32, &NodeId)> = node.children.iter().collect();
            kids.sort_unstable_by(|a, b| b.cmp(a));
            stack.extend(kids.into_iter().map(|(_, &c)| (c, run)));
        };
        for (_, &root) in salts {
            push_children(&mut stack, self.node(root), None);
            while let Some((id, parent)) = stack.pop() {
                let n = self.node(id);
                runs.push(super::CachedRun {
                    parent,
                    salt: n.salt,
                    tokens: n.key.clone(),
                    slots: n.slots.clone(),
                });
                push_children(&mut stack, n, Some(runs.len() - 1));
            }
        }
        runs
    }

    /// Whether `node` is a live, non-root node.
    pub fn is_live(&self, node: NodeId) -> bool {
        self.nodes
            .get(node as usize)
            .is_some_and(|n| n.alive && !n.is_root())
    }

    /// Every slot the tree owns (one per cached token).
    pub fn for_each_slot(&self, mut f: impl FnMut(u32)) {
        for n in self.nodes.iter().filter(|n| n.alive) {
            n.slots.iter().for_each(|&s| f(s));
        }
    }

    /// Lock count of a node (0 for unknown ids).
    pub fn lock_ref(&self, node: NodeId) -> u32 {
        self.nodes.get(node as usize).map_or(0, |n| n.lock_ref)
    }

    /// Structural check. `holders` lists, once per lock, the node locked.
    pub fn check(&self, holders: &[NodeId]) -> Result<(), String> {
        let mut expected = vec![0u32; self.nodes.len()];
        for &h in holders {
            if !self.is_live(h) {
                return Err(format!("a lock is held on dead or root node {h}"));
            }
            let mut n = h;
            while !self.node(n).is_root() {
                expected[n as usize] += 1;
                n = self.node(n).parent;
            }
        }
        let mut visited = vec![false; self.nodes.len()];
        let mut stack: Vec<NodeId> = Vec::new();
        for (&salt, &r) in &self.roots {
            let root = self.nodes.get(r as usize).ok_or("root id out of range")?;
            if !root.alive || !root.is_root() || root.salt != salt || !root.key.is_empty() {
                return Err(format!("root of salt {salt} is malformed"));
            }
            if root.children.is_empty() {
                return Err(format!(
                    "root of salt {salt} has no children and was not dropped"
                ));
            }
            if root.lock_ref != 0 || root.leaf_tick.is_some() {
                return Err(format!("root of salt {salt} is locked or evictable"));
            }
            visited[r as usize] = true;
            stack.push(r);
        }
        let (mut evictable, mut protected, mut leaves) = (0, 0, 0);
        while let Some(id) = stack.pop() {
            let nd = self.node(id);
            for (&tok, &c) in &nd.children {
                let child = self.nodes.get(c as usize).ok_or("child id out of range")?;
                if !child.alive || visited[c as usize] {
                    return Err(format!("node {c} is dead or reachable twice"));
                }
                visited[c as usize] = true;
                if child.parent != id || child.salt != nd.salt {
                    return Err(format!("node {c} has a wrong parent or salt"));
                }
                if child.key.is_empty()
                    || child.key[0] != tok
                    || child.key.len() != child.slots.len()
                {
                    return Err(format!("node {c} key does not match its edge or its slots"));
                }
                if child.lock_ref != expected[c as usize] {
                    return Err(format!(
                        "node {c} has lock count {} but {} holders",
                        child.lock_ref, expected[c as usize]
                    ));
                }
                if child.lock_ref == 0 {
                    evictable += child.key.len();
                } else {
                    protected += child.key.len();
                }
                let want_leaf = child.children.is_empty() && child.lock_ref == 0;
                if want_leaf {
                    leaves += 1;
                    if child.leaf_tick != Some(child.last_access)
                        || !self.leaves.contains(&(child.last_access, c))
                    {
                        return Err(format!("evictable leaf {c} is missing from the LRU set"));
                    }
                } else if child.leaf_tick.is_some() {
                    return Err(format!(
                        "node {c} is in the LRU set but not an unlocked leaf"
                    ));
                }
                stack.push(c);
            }
        }
        let alive = self.nodes.iter().filter(|n| n.alive).count();
        if alive != visited.iter().filter(|&&v| v).count() {
            return Err("some live nodes are unreachable from the roots".into());
        }
        if self.free_ids.iter().any(|&f| self.node(f).alive) {
            return Err("a live node is on the free id list".into());
        }
        if leaves != self.leaves.len() {
            return Err("the LRU set holds stale entries".into());
        }
        if evictable != self.evictable || protected != self.protected {
            return Err(format!(
                "size counters evictable={} protected={} but tree has {evictable}/{protected}",
                self.evictable, self.protected
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inserts from the root with slots `base..base+len` and returns the end node.
    fn put(
        t: &mut RadixTree,
        salt: u64,
        tokens: &[u32],
        base: u32,
    ) -> (NodeId, Vec<u32>, Vec<u32>) {
        let mut slots: Vec<u32> = (base..base + tokens.len() as u32).collect();
        let mut dups = Vec::new();
        let n = t.insert(salt, None, tokens, &mut slots, &mut dups).unwrap();
        (n, slots, dups)
    }

    fn get(t: &mut RadixTree, salt: u64, tokens: &[u32]) -> (Option<NodeId>, Vec<u32>) {
        let mut out = Vec::new();
        let n = t.match_prefix(salt, tokens, &mut out);
        (n, out)
    }

    #[test]
    fn match_splits_a_node_and_returns_its_slots() {
        let mut t = RadixTree::new();
        let (leaf, _, dups) = put(&mut t, 0, &[1, 2, 3, 4, 5], 100);
        assert!(dups.is_empty());
        t.check(&[]).unwrap();
        let (n, slots) = get(&mut t, 0, &[1, 2, 3, 9]);
        assert_eq!(slots, vec![100, 101, 102]);
        let n = n.unwrap();
        assert_ne!(n, leaf, "the match ends inside the node, so it is split");
        assert_eq!(t.path_slots(n), vec![100, 101, 102]);
        assert_eq!(
            t.path_slots(leaf),
            vec![100, 101, 102, 103, 104],
            "lower part keeps its id"
        );
        t.check(&[]).unwrap();
        assert_eq!(t.evictable_size(), 5, "splitting does not change sizes");
        // Full and empty matches.
        assert_eq!(
            get(&mut t, 0, &[1, 2, 3, 4, 5, 6]).1,
            vec![100, 101, 102, 103, 104]
        );
        assert_eq!(get(&mut t, 0, &[7]), (None, vec![]));
        assert_eq!(
            get(&mut t, 1, &[1, 2]),
            (None, vec![]),
            "salts are separate trees"
        );
    }

    #[test]
    fn insert_reuses_existing_slots_and_reports_duplicates() {
        let mut t = RadixTree::new();
        put(&mut t, 0, &[1, 2, 3, 4], 10);
        // Shares [1, 2], diverges at the third token.
        let (n, slots, dups) = put(&mut t, 0, &[1, 2, 7, 8, 9], 20);
        assert_eq!(slots, vec![10, 11, 22, 23, 24]);
        assert_eq!(dups, vec![20, 21]);
        assert_eq!(t.path_slots(n), slots);
        assert_eq!(t.total_size(), 7);
        t.check(&[]).unwrap();
        // Inserting an already cached run adds nothing new.
        let (n2, slots2, dups2) = put(&mut t, 0, &[1, 2, 3], 40);
        assert_eq!(slots2, vec![10, 11, 12]);
        assert_eq!(dups2, vec![40, 41, 42]);
        assert_eq!(t.path_slots(n2), vec![10, 11, 12]);
        assert_eq!(t.total_size(), 7);
        t.check(&[]).unwrap();
        // Inserting the same slots again reports no duplicates.
        let mut same = vec![10, 11, 12, 13];
        let mut d = Vec::new();
        t.insert(0, None, &[1, 2, 3, 4], &mut same, &mut d);
        assert!(d.is_empty());
    }

    #[test]
    fn insert_continues_below_a_given_node() {
        let mut t = RadixTree::new();
        let (a, _, _) = put(&mut t, 3, &[5, 6], 1);
        let mut tail = vec![3, 4];
        let mut dups = Vec::new();
        let b = t.insert(3, Some(a), &[7, 8], &mut tail, &mut dups).unwrap();
        assert_eq!(t.path_slots(b), vec![1, 2, 3, 4]);
        assert_eq!(get(&mut t, 3, &[5, 6, 7, 8]).1, vec![1, 2, 3, 4]);
        t.check(&[]).unwrap();
    }

    #[test]
    fn locks_pin_paths_and_eviction_follows_lru() {
        let mut t = RadixTree::new();
        let (a, _, _) = put(&mut t, 0, &[1, 1, 1, 1], 10); // oldest
        let (b, _, _) = put(&mut t, 0, &[2, 2, 2, 2], 20);
        let (c, _, _) = put(&mut t, 0, &[3, 3, 3, 3], 30); // newest
        t.lock(a);
        assert_eq!((t.evictable_size(), t.protected_size()), (8, 4));
        t.check(&[a]).unwrap();
        // a is locked, so b (older than c) goes first; partial eviction trims its tail.
        let mut freed = Vec::new();
        assert_eq!(t.evict(3, &mut freed), 3);
        assert_eq!(freed, vec![21, 22, 23]);
        assert_eq!(
            get(&mut t, 0, &[2, 2, 2, 2]).1,
            vec![20],
            "b keeps its first token"
        );
        t.check(&[a]).unwrap();
        // That match made b recent again, so c is now the LRU leaf.
        freed.clear();
        assert_eq!(t.evict(4, &mut freed), 4);
        assert_eq!(freed, vec![30, 31, 32, 33]);
        assert!(!t.is_live(c));
        // Unlocking a makes it the most recently used; b goes before it.
        t.unlock(a);
        freed.clear();
        assert_eq!(t.evict(2, &mut freed), 2);
        assert_eq!(freed, vec![20, 13]);
        t.check(&[]).unwrap();
        freed.clear();
        assert_eq!(t.evict(100, &mut freed), 3, "evicts only what exists");
        assert_eq!(t.total_size(), 0);
        assert!(!t.is_live(b));
        t.check(&[]).unwrap();
        assert_eq!(
            get(&mut t, 0, &[1]),
            (None, vec![]),
            "the empty root was dropped"
        );
    }

    #[test]
    fn extend_leaf_only_for_a_solely_locked_leaf() {
        let mut t = RadixTree::new();
        let (a, _, _) = put(&mut t, 0, &[1, 2], 10);
        assert!(
            !t.extend_leaf(a, &[3], &[12]),
            "unlocked leaves are not extended"
        );
        t.lock(a);
        assert!(t.extend_leaf(a, &[3, 4], &[12, 13]));
        assert_eq!(t.num_nodes(), 2, "root + one leaf");
        t.check(&[a]).unwrap();
        assert_eq!(get(&mut t, 0, &[1, 2, 3, 4, 5]).1, vec![10, 11, 12, 13]);
        t.lock(a);
        assert!(
            !t.extend_leaf(a, &[5], &[14]),
            "a leaf shared by two holders is not extended"
        );
        t.unlock(a);
        // An inner node (after a split) is not extended either.
        let (b, _, _) = put(&mut t, 0, &[1, 2, 9], 20);
        let mut out = Vec::new();
        let upper = t.match_prefix(0, &[1, 2], &mut out).unwrap();
        assert!(!t.extend_leaf(upper, &[7], &[30]));
        assert!(t.is_live(b));
        t.check(&[a]).unwrap();
    }

    #[test]
    fn inner_nodes_become_evictable_after_their_children() {
        let mut t = RadixTree::new();
        put(&mut t, 0, &[1, 2, 3], 10);
        let (deep, _, _) = put(&mut t, 0, &[1, 2, 4], 20); // splits at [1, 2]
        t.lock(deep);
        let mut freed = Vec::new();
        // Only [3] is an unlocked leaf; the shared [1, 2] is pinned by `deep`.
        assert_eq!(t.evict(10, &mut freed), 1);
        assert_eq!(freed, vec![12]);
        t.check(&[deep]).unwrap();
        t.unlock(deep);
        freed.clear();
        assert_eq!(t.evict(10, &mut freed), 3);
        freed.sort_unstable();
        assert_eq!(freed, vec![10, 11, 22]);
        t.check(&[]).unwrap();
    }
}
