//! A buddy allocator over offsets `0..capacity` of one region (no memory of
//! its own: `CudaBuddy` puts it over one device allocation).
//!
//! Blocks are powers of two from `min_block` up, each at an offset that is
//! a multiple of its size. A capacity that is not a power of two is covered
//! by several top-level blocks, largest first (the binary decomposition of
//! the capacity), so every block still sits at a multiple of its size.
//!
//! An allocation of `n` bytes (rounded up to `min_block`) is the binary
//! decomposition of `n` laid out largest piece first from an offset aligned
//! to the largest piece: it wastes less than `min_block`, where a classic
//! buddy allocator would round up to the next power of two (a 10 GiB KV
//! cache would take 16 GiB). Each piece is an ordinary buddy block, split
//! off free blocks on allocation and merged with its buddy on release.
//! With one piece this is the classic algorithm: best fit by order, lowest
//! address first.

use std::collections::{BTreeMap, BTreeSet};

use crate::{Error, ErrorKind, Result};

/// Largest block order (2^62 bytes); keeps every shift below 64.
const MAX_ORDER: u32 = 62;

/// One allocation: its offset and the bytes it covers (a multiple of the
/// minimum block).
#[derive(Debug, PartialEq, Eq)]
pub struct BuddyBlock {
    pub offset: usize,
    pub size: usize,
}

/// The allocator (see the module docs).
#[derive(Debug, Clone)]
pub struct BuddyAllocator {
    min_order: u32,
    capacity: usize,
    /// Free block offsets per order.
    free: Vec<BTreeSet<usize>>,
    /// Live allocations: offset → bytes covered.
    live: BTreeMap<usize, usize>,
    /// Top-level blocks (offset, order), by offset.
    tops: Vec<(usize, u32)>,
    used: usize,
    peak: usize,
}

fn oom(size: usize, why: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::OutOfMemory,
        format!("buddy allocator: cannot allocate {size} bytes: {why}"),
    )
}

impl BuddyAllocator {
    /// An allocator over `capacity` bytes (rounded down to a multiple of
    /// `min_block`, a power of two).
    pub fn new(capacity: usize, min_block: usize) -> Result<Self> {
        if !min_block.is_power_of_two() {
            return Err(Error::invalid_arg(format!(
                "buddy allocator: minimum block {min_block} is not a power of two"
            )));
        }
        let min_order = min_block.trailing_zeros();
        let capacity = capacity & !(min_block - 1);
        let mut a = BuddyAllocator {
            min_order,
            capacity,
            free: vec![BTreeSet::new(); MAX_ORDER as usize + 1],
            live: BTreeMap::new(),
            tops: Vec::new(),
            used: 0,
            peak: 0,
        };
        let mut offset = 0;
        for order in (min_order..=MAX_ORDER.min(usize::BITS - 1)).rev() {
            if capacity & (1 << order) != 0 {
                a.tops.push((offset, order));
                a.free[order as usize].insert(offset);
                offset += 1 << order;
            }
        }
        Ok(a)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn min_block(&self) -> usize {
        1 << self.min_order
    }

    /// Bytes covered by live allocations.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Highest `used` so far.
    pub fn peak(&self) -> usize {
        self.peak
    }

    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }

    /// The largest free block in bytes (0 when full).
    pub fn largest_free_block(&self) -> usize {
        (0..self.free.len())
            .rev()
            .find(|&o| !self.free[o].is_empty())
            .map_or(0, |o| 1 << o)
    }

    /// True when nothing is allocated and every block is merged back into
    /// the top-level blocks.
    pub fn is_pristine(&self) -> bool {
        let free_blocks: usize = self.free.iter().map(BTreeSet::len).sum();
        self.live.is_empty()
            && free_blocks == self.tops.len()
            && self
                .tops
                .iter()
                .all(|&(off, order)| self.free[order as usize].contains(&off))
    }

    /// The pieces (offset, order) of `bytes` laid out from `start`.
    fn pieces(&self, start: usize, bytes: usize) -> impl Iterator<Item = (usize, u32)> {
        let mut at = start;
        (self.min_order..=MAX_ORDER)
            .rev()
            .filter(move |&o| bytes & (1 << o) != 0)
            .map(move |o| {
                let p = (at, o);
                at += 1 << o;
                p
            })
    }

    /// The free block (offset, order) of order ≥ `order` containing the
    /// aligned block at `offset`, if that whole block is free.
    fn free_container(&self, offset: usize, order: u32) -> Option<(usize, u32)> {
        (order..=MAX_ORDER).find_map(|o| {
            let start = offset & !((1usize << o) - 1);
            self.free[o as usize].contains(&start).then_some((start, o))
        })
    }

    /// Takes the aligned block (offset, order) out of the free structure,
    /// splitting the free block that contains it. It must be free.
    fn carve(&mut self, offset: usize, order: u32) {
        let (mut start, mut o) = self
            .free_container(offset, order)
            .expect("carve: the block was checked free");
        self.free[o as usize].remove(&start);
        while o > order {
            o -= 1;
            let half = 1usize << o;
            // Keep the half containing `offset`, free the other.
            if offset >= start + half {
                self.free[o as usize].insert(start);
                start += half;
            } else {
                self.free[o as usize].insert(start + half);
            }
        }
    }

    /// Allocates `size` bytes aligned to `align` (a power of two; offsets
    /// are relative to the region's start). Zero bytes take one minimum block.
    pub fn allocate(&mut self, size: usize, align: usize) -> Result<BuddyBlock> {
        if !align.is_power_of_two() {
            return Err(Error::invalid_arg(format!(
                "buddy allocator: alignment {align} is not a power of two"
            )));
        }
        let min = self.min_block();
        let mut bytes = size
            .max(1)
            .checked_next_multiple_of(min)
            .filter(|&b| b <= self.capacity)
            .ok_or_else(|| oom(size, format!("the region holds {} bytes", self.capacity)))?;
        let top_order = usize::BITS - 1 - bytes.leading_zeros();
        if align > 1 << top_order {
            // The first piece is aligned to its size: make it one block.
            bytes = bytes
                .max(align)
                .checked_next_power_of_two()
                .filter(|&b| b <= self.capacity)
                .ok_or_else(|| {
                    oom(
                        size,
                        format!("align {align} exceeds the region's {} bytes", self.capacity),
                    )
                })?;
        }
        let top_order = usize::BITS - 1 - bytes.leading_zeros();
        // Candidate starts: free blocks of order ≥ the first piece's, the
        // smallest order first, lowest address first. A block larger than
        // the first piece holds the whole allocation; one of equal order
        // needs the blocks after it to be free.
        let mut found = None;
        'search: for o in top_order..=MAX_ORDER {
            for &start in &self.free[o as usize] {
                if start + bytes > self.capacity {
                    continue;
                }
                if self
                    .pieces(start, bytes)
                    .all(|(p, po)| self.free_container(p, po).is_some())
                {
                    found = Some(start);
                    break 'search;
                }
            }
        }
        let start = found.ok_or_else(|| {
            oom(
                size,
                format!(
                    "{} of {} bytes in use, largest free block {} bytes",
                    self.used,
                    self.capacity,
                    self.largest_free_block()
                ),
            )
        })?;
        let pieces: Vec<_> = self.pieces(start, bytes).collect();
        for (p, o) in pieces {
            self.carve(p, o);
        }
        self.live.insert(start, bytes);
        self.used += bytes;
        self.peak = self.peak.max(self.used);
        Ok(BuddyBlock {
            offset: start,
            size: bytes,
        })
    }

    /// The order of the top-level block containing `offset`.
    fn top_order(&self, offset: usize) -> u32 {
        let i = self.tops.partition_point(|&(off, _)| off <= offset) - 1;
        self.tops[i].1
    }

    /// Gives back the allocation at `offset`. An offset that is not a live
    /// allocation (released twice, or never handed out) is refused and
    /// changes nothing. Returns the bytes freed.
    pub fn release(&mut self, offset: usize) -> Result<usize> {
        let bytes = self.live.remove(&offset).ok_or_else(|| {
            Error::invalid_arg(format!(
                "buddy allocator: no live allocation at offset {offset} (released twice, or not from this allocator)"
            ))
        })?;
        let pieces: Vec<_> = self.pieces(offset, bytes).collect();
        for (mut p, mut o) in pieces {
            let top = self.top_order(p);
            while o < top {
                let buddy = p ^ (1 << o);
                if !self.free[o as usize].remove(&buddy) {
                    break;
                }
                p = p.min(buddy);
                o += 1;
            }
            self.free[o as usize].insert(p);
        }
        self.used -= bytes;
        Ok(bytes)
    }

    /// The smallest capacity (a multiple of `min_block`) over which
    /// allocating `requests` (size, align) in order succeeds.
    pub fn capacity_for(requests: &[(usize, usize)], min_block: usize) -> Result<usize> {
        let rounded: usize = requests
            .iter()
            .map(|&(s, _)| s.max(1).next_multiple_of(min_block.max(1)))
            .sum();
        // Growth step: a fraction of what is not the largest request (a
        // huge KV cache placed first fits exactly; the gaps come from the
        // smaller ones' alignment).
        let largest = requests
            .iter()
            .map(|&(s, _)| s.max(1).next_multiple_of(min_block.max(1)))
            .max()
            .unwrap_or(0);
        let step = ((rounded - largest) / 16).max(min_block.max(1));
        let mut capacity = rounded;
        loop {
            let mut a = BuddyAllocator::new(capacity, min_block)?;
            if requests.iter().all(|&(s, al)| a.allocate(s, al).is_ok()) {
                return Ok(capacity);
            }
            // Alignment of a later piece left a gap: grow and retry.
            capacity = (capacity + step).next_multiple_of(min_block);
            if capacity > rounded.saturating_mul(4) {
                return Err(oom(
                    rounded,
                    "no layout of the requested blocks found (alignment too large?)",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::rng::SplitMix64;

    /// Checks the free blocks and the live allocations tile the region
    /// exactly: disjoint, aligned, covering everything.
    fn check_tiling(a: &BuddyAllocator) {
        let mut spans: Vec<(usize, usize)> = a.live.iter().map(|(&o, &b)| (o, b)).collect();
        for (order, set) in a.free.iter().enumerate() {
            for &off in set {
                assert_eq!(off % (1 << order), 0, "free block {off} of order {order}");
                spans.push((off, 1 << order));
            }
        }
        spans.sort();
        let mut at = 0;
        for (off, len) in spans {
            assert_eq!(off, at, "gap or overlap at {at}");
            at += len;
        }
        assert_eq!(at, a.capacity());
        assert_eq!(a.used(), a.live.values().sum::<usize>());
    }

    #[test]
    fn power_of_two_region_allocates_and_merges() {
        let mut a = BuddyAllocator::new(4096, 256).unwrap();
        let b1 = a.allocate(100, 1).unwrap();
        assert_eq!(
            b1,
            BuddyBlock {
                offset: 0,
                size: 256
            }
        );
        let b2 = a.allocate(256, 256).unwrap();
        assert_eq!(b2.offset, 256);
        let b3 = a.allocate(1024, 1024).unwrap();
        assert_eq!(b3.offset, 1024);
        check_tiling(&a);
        for b in [b2, b1, b3] {
            a.release(b.offset).unwrap();
            check_tiling(&a);
        }
        assert!(a.is_pristine());
        assert_eq!(a.used(), 0);
        assert_eq!(a.peak(), 1536);
    }

    #[test]
    fn non_power_of_two_region_has_several_tops() {
        // 10 KiB + 256 = 8 KiB + 2 KiB + 256 B.
        let a = BuddyAllocator::new(10 * 1024 + 256 + 17, 256).unwrap();
        assert_eq!(a.capacity(), 10 * 1024 + 256);
        assert_eq!(a.tops, vec![(0, 13), (8192, 11), (10240, 8)]);
        assert!(a.is_pristine());
    }

    #[test]
    fn odd_sizes_take_exactly_their_rounded_bytes() {
        // A 10-block allocation in a 10-block region: 8 + 2 pieces.
        let mut a = BuddyAllocator::new(10 * 256, 256).unwrap();
        let b = a.allocate(9 * 256 + 1, 256).unwrap();
        assert_eq!(
            b,
            BuddyBlock {
                offset: 0,
                size: 10 * 256
            }
        );
        assert_eq!(a.largest_free_block(), 0);
        check_tiling(&a);
        a.release(0).unwrap();
        assert!(a.is_pristine());
        // 3 blocks in a 4-block region: pieces 2 + 1, the last block free.
        let mut a = BuddyAllocator::new(1024, 256).unwrap();
        let b = a.allocate(768, 1).unwrap();
        assert_eq!(
            b,
            BuddyBlock {
                offset: 0,
                size: 768
            }
        );
        let c = a.allocate(1, 1).unwrap();
        assert_eq!(c.offset, 768);
        check_tiling(&a);
    }

    #[test]
    fn out_of_space_is_an_error_not_a_panic() {
        let mut a = BuddyAllocator::new(1024, 256).unwrap();
        let e = a.allocate(2048, 1).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        let e = a.allocate(usize::MAX, 1).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        let _x = a.allocate(512, 1).unwrap();
        let _y = a.allocate(256, 1).unwrap();
        let e = a.allocate(512, 1).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(
            e.message.contains("largest free block 256"),
            "{}",
            e.message
        );
        // Fragmented: 512 free in total, but not aligned together.
        let mut a = BuddyAllocator::new(1024, 256).unwrap();
        let blocks: Vec<_> = (0..4).map(|_| a.allocate(256, 1).unwrap()).collect();
        a.release(blocks[1].offset).unwrap();
        a.release(blocks[2].offset).unwrap();
        assert_eq!(a.allocate(512, 1).unwrap_err().kind, ErrorKind::OutOfMemory);
        // An alignment beyond the region.
        assert_eq!(
            a.allocate(1, 4096).unwrap_err().kind,
            ErrorKind::OutOfMemory
        );
        assert_eq!(
            a.allocate(1, 3).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        check_tiling(&a);
    }

    #[test]
    fn double_and_foreign_releases_are_refused() {
        let mut a = BuddyAllocator::new(4096, 256).unwrap();
        let b = a.allocate(300, 1).unwrap();
        let other = a.allocate(256, 1).unwrap();
        // Inside a live allocation but not its start.
        assert_eq!(
            a.release(b.offset + 256).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            a.release(1 << 20).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(a.release(b.offset).unwrap(), 512);
        let e = a.release(b.offset).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("released twice"), "{}", e.message);
        check_tiling(&a);
        a.release(other.offset).unwrap();
        assert!(a.is_pristine());
    }

    #[test]
    fn alignment_is_honoured() {
        let mut a = BuddyAllocator::new(1 << 16, 256).unwrap();
        let _small = a.allocate(256, 1).unwrap();
        for align in [256, 512, 4096, 1 << 14] {
            let b = a.allocate(300, align).unwrap();
            assert_eq!(b.offset % align, 0, "align {align}");
        }
        check_tiling(&a);
    }

    #[test]
    fn random_sequences_against_a_model() {
        for seed in 1..=40u64 {
            let mut rng = SplitMix64::new(seed);
            let min = 1usize << (4 + rng.below(5));
            let capacity = min * (1 + rng.below(300)) + rng.below(min);
            let mut a = BuddyAllocator::new(capacity, min).unwrap();
            // The model: live (offset, requested size, align).
            let mut model: Vec<(usize, usize, usize)> = Vec::new();
            for _ in 0..400 {
                if model.is_empty() || rng.below(100) < 55 {
                    let size = match rng.below(4) {
                        0 => rng.below(min),
                        1 => rng.below(8 * min),
                        _ => rng.below(capacity / 4 + 1),
                    };
                    let align = 1usize << rng.below(12);
                    match a.allocate(size, align) {
                        Ok(b) => {
                            assert!(b.size >= size.max(1) && b.size % min == 0);
                            assert!(b.size < size.max(1) + min || b.size.is_power_of_two());
                            assert_eq!(b.offset % align, 0);
                            assert!(b.offset + b.size <= a.capacity());
                            for &(o, s, _) in &model {
                                let end = o + a.live[&o];
                                assert!(
                                    b.offset >= end || b.offset + b.size <= o,
                                    "{o}+{s} overlaps"
                                );
                            }
                            model.push((b.offset, size, align));
                        }
                        Err(e) => assert_eq!(e.kind, ErrorKind::OutOfMemory),
                    }
                } else {
                    let i = rng.below(model.len());
                    let (o, _, _) = model.swap_remove(i);
                    a.release(o).unwrap();
                    assert!(a.release(o).is_err(), "double release accepted");
                }
                assert_eq!(a.live_allocations(), model.len());
                check_tiling(&a);
            }
            for (o, _, _) in model.drain(..) {
                a.release(o).unwrap();
            }
            assert!(a.is_pristine(), "seed {seed}: not merged back");
            assert_eq!(a.used(), 0);
        }
    }

    #[test]
    fn capacity_for_fits_the_sequence_tightly() {
        let reqs = [(3 * 256, 256), (3 * 256, 256), (5000, 256), (1, 256)];
        let cap = BuddyAllocator::capacity_for(&reqs, 256).unwrap();
        let sum: usize = reqs.iter().map(|&(s, _)| s.next_multiple_of(256)).sum();
        assert!(cap >= sum && cap <= 2 * sum, "{cap} vs {sum}");
        let mut a = BuddyAllocator::new(cap, 256).unwrap();
        for (s, al) in reqs {
            a.allocate(s, al).unwrap();
        }
        // A KV-like first allocation plus small ones: close to the sum.
        let reqs = [(10 << 20, 256), (12345, 256), (999, 256), (70000, 256)];
        let cap = BuddyAllocator::capacity_for(&reqs, 256).unwrap();
        let sum: usize = reqs.iter().map(|&(s, _)| s.next_multiple_of(256)).sum();
        let rest = sum - (10 << 20);
        assert!(
            cap <= sum + rest,
            "{cap} vs {sum}: the slack follows the small requests"
        );
        let mut a = BuddyAllocator::new(cap, 256).unwrap();
        for (s, al) in reqs {
            a.allocate(s, al).unwrap();
        }
        assert_eq!(BuddyAllocator::capacity_for(&[], 256).unwrap(), 0);
    }
}
