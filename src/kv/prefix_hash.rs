//! Chained 128-bit keys for full KV blocks (the paged prefix cache).
//!
//! A block's key depends on its tokens and on the key of the block before it,
//! so equal keys mean equal whole prefixes (salt included). Keys are 128 bits
//! so that a collision, which would silently hand a sequence someone else's
//! KV, is out of reach in practice; the hash map compares full keys on hit.
//! Keys are stable within a process only, which is all an in-memory cache needs.

use std::hash::{BuildHasher, DefaultHasher, Hasher};

/// Identity of a full block: its tokens and everything before it.
pub type BlockKey = u128;

const SEED_HI: u64 = 0x9e37_79b9_7f4a_7c15;
const SEED_LO: u64 = 0xc2b2_ae3d_27d4_eb4f;
const ROOT_TAG: u64 = 0x6b76_2d72_6f6f_7421;

/// Two SipHash streams with different seeds give the two 64-bit halves.
fn hash128(parent: u128, tag: u64, tokens: &[u32]) -> BlockKey {
    let half = |seed: u64| {
        // `DefaultHasher::new()` uses fixed keys, so results are reproducible.
        let mut h = DefaultHasher::new();
        h.write_u64(seed);
        h.write_u128(parent);
        h.write_u64(tag);
        h.write_usize(tokens.len());
        for &t in tokens {
            h.write_u32(t);
        }
        h.finish()
    };
    ((half(SEED_HI) as u128) << 64) | half(SEED_LO) as u128
}

/// The virtual parent of a sequence's first block; carries the salt into the chain.
pub fn root_key(salt: u64) -> BlockKey {
    hash128(salt as u128, ROOT_TAG, &[])
}

/// Key of a full block holding `tokens`, whose predecessor has key `parent`.
pub fn block_key(parent: BlockKey, tokens: &[u32]) -> BlockKey {
    hash128(parent, 0, tokens)
}

/// Hasher for maps keyed by `BlockKey`: the key already is a uniform hash,
/// so folding its halves is enough (and much cheaper than hashing it again).
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64) ^ ((v >> 64) as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u128 keys; FNV-1a keeps it correct.
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// `BuildHasher` for `HashMap<BlockKey, _>`.
#[derive(Default, Clone, Copy)]
pub struct KeyBuild;

impl BuildHasher for KeyBuild {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_tokens_parent_and_salt() {
        let r0 = root_key(0);
        let r1 = root_key(1);
        assert_ne!(r0, r1);
        let a = block_key(r0, &[1, 2, 3]);
        assert_eq!(a, block_key(r0, &[1, 2, 3]), "keys must be deterministic");
        assert_ne!(a, block_key(r1, &[1, 2, 3]), "salt must change the key");
        assert_ne!(a, block_key(r0, &[1, 2, 4]));
        assert_ne!(a, block_key(r0, &[1, 2]));
        let b = block_key(a, &[4, 5, 6]);
        assert_ne!(b, block_key(block_key(r0, &[1, 2, 7]), &[4, 5, 6]));
        assert_ne!(
            a >> 64,
            a & u64::MAX as u128,
            "halves come from different seeds"
        );
    }
}
