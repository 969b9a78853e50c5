//! The byte formats of saved state: one sequence (a conversation: its
//! tokens, the KV of its computed positions, where its sampler's output
//! history starts and its RNG state) and a prefix cache (cached token runs
//! with their KV, as a forest: each run continues its parent's tokens).
//!
//! Layout, little-endian:
//! ```text
//! magic           8 bytes   "NISEQ\0v1" (sequence) or "NIPFX\0v1" (prefix cache)
//! fingerprint     u128      the model's (model::fingerprint)
//! kv_format       u16 length + UTF-8   e.g. "cpu auto 46080"
//! values_per_slot u32       f32 values one position's KV holds (all layers, K and V)
//! body            see `SavedSequence::write` / `SavedPrefixes::write`
//! checksum        u64       xxh3-64 of every byte before it
//! ```
//! KV is stored as f32 whatever the device keeps (the exact values of a
//! 16-bit or FP8 cache: it is written back bit for bit).
//!
//! A state file is hostile input: every size in it is checked against the
//! loading session's limits and against the bytes actually left before
//! anything is allocated, allocations are fallible, KV values must be
//! finite, token ids must be in the vocabulary, and the checksum must
//! match before any of it is used.

use crate::memory::try_with_capacity;
use crate::model::fingerprint::fingerprint_hex;
use crate::{Error, Result};
use std::io::{Read, Write};
use xxhash_rust::xxh3::Xxh3;

const SEQUENCE_MAGIC: [u8; 8] = *b"NISEQ\0v1";
const PREFIXES_MAGIC: [u8; 8] = *b"NIPFX\0v1";
/// Longest KV format description accepted.
const MAX_KV_FORMAT: usize = 256;
/// Bytes converted per chunk when streaming f32 arrays.
const CHUNK_VALUES: usize = 16 * 1024;

/// What the loading session expects of a state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateIdentity {
    pub fingerprint: u128,
    /// The KV cache's device, dtype and bytes per position, as text.
    pub kv_format: String,
    pub values_per_slot: usize,
    /// Token ids must be below this.
    pub vocab: usize,
    /// The most tokens one sequence may hold in the session.
    pub max_tokens: usize,
}

/// One saved sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedSequence {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Where the sampler's output history starts in `tokens` (the original
    /// prompt's length): presence and frequency penalties count from here.
    pub history_start: usize,
    /// Positions `0..kv_positions` have their KV in `kv`.
    pub kv_positions: usize,
    /// `kv_positions * values_per_slot` values, position after position.
    pub kv: Vec<f32>,
    /// The sampler's RNG state.
    pub rng: [u64; 4],
}

/// One cached token run of a saved prefix cache.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedRun {
    /// The run it continues (an earlier index), `None` at the root.
    pub parent: Option<usize>,
    /// The cache salt it was cached under.
    pub salt: u64,
    pub tokens: Vec<u32>,
    /// `tokens.len() * values_per_slot` values.
    pub kv: Vec<f32>,
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::invalid_arg(format!("saved state is corrupt or truncated: {what}"))
}

fn write_err(e: std::io::Error) -> Error {
    Error::io("writing saved state", e)
}

/// A writer that checksums what passes through it.
struct HashWriter<'a> {
    out: &'a mut dyn Write,
    hash: Xxh3,
}

impl<'a> HashWriter<'a> {
    fn new(out: &'a mut dyn Write) -> Self {
        HashWriter {
            out,
            hash: Xxh3::new(),
        }
    }

    fn bytes(&mut self, b: &[u8]) -> Result<()> {
        self.hash.update(b);
        self.out.write_all(b).map_err(write_err)
    }

    fn u32(&mut self, v: usize) -> Result<()> {
        let v = u32::try_from(v)
            .map_err(|_| Error::invalid_arg(format!("{v} is too large for a saved state")))?;
        self.bytes(&v.to_le_bytes())
    }

    fn u64(&mut self, v: u64) -> Result<()> {
        self.bytes(&v.to_le_bytes())
    }

    fn tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.u32(tokens.len())?;
        let mut buf = Vec::with_capacity(tokens.len().min(CHUNK_VALUES) * 4);
        for chunk in tokens.chunks(CHUNK_VALUES) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            self.bytes(&buf)?;
        }
        Ok(())
    }

    fn f32s(&mut self, values: &[f32]) -> Result<()> {
        let mut buf = Vec::with_capacity(values.len().min(CHUNK_VALUES) * 4);
        for chunk in values.chunks(CHUNK_VALUES) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            self.bytes(&buf)?;
        }
        Ok(())
    }

    fn header(&mut self, magic: [u8; 8], id: &StateIdentity) -> Result<()> {
        self.bytes(&magic)?;
        self.bytes(&id.fingerprint.to_le_bytes())?;
        let format = id.kv_format.as_bytes();
        self.bytes(&(format.len().min(MAX_KV_FORMAT) as u16).to_le_bytes())?;
        self.bytes(&format[..format.len().min(MAX_KV_FORMAT)])?;
        self.u32(id.values_per_slot)
    }

    fn finish(self) -> Result<()> {
        let sum = self.hash.digest();
        self.out.write_all(&sum.to_le_bytes()).map_err(write_err)?;
        self.out.flush().map_err(write_err)
    }
}

/// A reader over `remaining` bytes that checksums what it reads and refuses
/// to allocate for more than is left.
struct HashReader<'a> {
    input: &'a mut dyn Read,
    hash: Xxh3,
    remaining: u64,
}

impl<'a> HashReader<'a> {
    fn new(input: &'a mut dyn Read, len: u64) -> Self {
        HashReader {
            input,
            hash: Xxh3::new(),
            remaining: len,
        }
    }

    /// Fails unless `n` more bytes (plus the checksum) are there.
    fn ensure(&self, n: u64, what: &str) -> Result<()> {
        if n.saturating_add(8) > self.remaining {
            return Err(corrupt(format!(
                "{what} needs {n} bytes but only {} remain",
                self.remaining.saturating_sub(8)
            )));
        }
        Ok(())
    }

    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.ensure(buf.len() as u64, what)?;
        self.input.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => corrupt(format!("it ends inside {what}")),
            _ => Error::io("reading saved state", e),
        })?;
        self.hash.update(buf);
        self.remaining -= buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<usize> {
        Ok(u32::from_le_bytes(self.array(what)?) as usize)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// `n` 4-byte words, decoded by `decode` into a fallibly allocated vector.
    fn words<T>(&mut self, n: usize, what: &str, decode: impl Fn([u8; 4]) -> T) -> Result<Vec<T>> {
        self.ensure((n as u64).saturating_mul(4), what)?;
        let mut out = try_with_capacity(n, what)?;
        let mut buf = vec![0u8; n.min(CHUNK_VALUES) * 4];
        let mut left = n;
        while left > 0 {
            let take = left.min(CHUNK_VALUES);
            self.fill(&mut buf[..take * 4], what)?;
            out.extend(
                buf[..take * 4]
                    .chunks_exact(4)
                    .map(|w| decode([w[0], w[1], w[2], w[3]])),
            );
            left -= take;
        }
        Ok(out)
    }

    /// A token list of at most `max` ids, each below `vocab`.
    fn tokens(&mut self, max: usize, vocab: usize, what: &str) -> Result<Vec<u32>> {
        let n = self.u32(what)?;
        if n > max {
            return Err(corrupt(format!(
                "{what} holds {n} tokens, more than the {max} this session allows"
            )));
        }
        let tokens = self.words(n, what, u32::from_le_bytes)?;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(corrupt(format!(
                "{what} holds token id {bad}, outside the vocabulary (size {vocab})"
            )));
        }
        Ok(tokens)
    }

    /// `positions` positions of KV, all finite.
    fn kv(&mut self, positions: usize, per_slot: usize, what: &str) -> Result<Vec<f32>> {
        let n = positions
            .checked_mul(per_slot)
            .ok_or_else(|| corrupt(format!("{what}: {positions} positions overflow")))?;
        let kv = self.words(n, what, f32::from_le_bytes)?;
        if let Some(i) = kv.iter().position(|v| !v.is_finite()) {
            return Err(corrupt(format!(
                "{what} holds a non-finite value at position {}",
                i / per_slot.max(1)
            )));
        }
        Ok(kv)
    }

    /// Reads and checks the header against `id`.
    fn header(&mut self, magic: [u8; 8], id: &StateIdentity) -> Result<()> {
        let found: [u8; 8] = self.array("the header")?;
        if found != magic {
            let other = if magic == SEQUENCE_MAGIC {
                PREFIXES_MAGIC
            } else {
                SEQUENCE_MAGIC
            };
            return Err(Error::invalid_arg(if found == other {
                format!(
                    "this is a saved {}, not a saved {}",
                    kind_name(other),
                    kind_name(magic)
                )
            } else {
                format!(
                    "not a NanoInfer saved {} (bad magic bytes)",
                    kind_name(magic)
                )
            }));
        }
        let fingerprint = u128::from_le_bytes(self.array("the header")?);
        if fingerprint != id.fingerprint {
            return Err(Error::invalid_arg(format!(
                "saved state belongs to another model (fingerprint {}, this session's model has {}): \
                 state restores only into the same weights, architecture and dtype",
                fingerprint_hex(fingerprint),
                fingerprint_hex(id.fingerprint)
            )));
        }
        let len = u16::from_le_bytes(self.array("the header")?) as usize;
        if len > MAX_KV_FORMAT {
            return Err(corrupt(format!("a KV format name of {len} bytes")));
        }
        let mut name = vec![0u8; len];
        self.fill(&mut name, "the header")?;
        let name = String::from_utf8_lossy(&name);
        if name != id.kv_format {
            return Err(Error::invalid_arg(format!(
                "saved state holds a KV cache of format `{name}` but this session's is `{}` \
                 (device, KV dtype and size per token must match)",
                id.kv_format
            )));
        }
        let per_slot = self.u32("the header")?;
        if per_slot != id.values_per_slot {
            return Err(corrupt(format!(
                "{per_slot} KV values per position where the model has {}",
                id.values_per_slot
            )));
        }
        Ok(())
    }

    /// Checks the checksum and that nothing follows it.
    fn finish(mut self) -> Result<()> {
        let expected = self.hash.digest();
        if self.remaining != 8 {
            return Err(corrupt(format!(
                "{} bytes follow the content where the 8-byte checksum should end the file",
                self.remaining
            )));
        }
        let mut b = [0u8; 8];
        self.input.read_exact(&mut b).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => corrupt("it ends inside the checksum"),
            _ => Error::io("reading saved state", e),
        })?;
        self.remaining = 0;
        if u64::from_le_bytes(b) != expected {
            return Err(corrupt("the checksum does not match its content"));
        }
        Ok(())
    }
}

fn kind_name(magic: [u8; 8]) -> &'static str {
    if magic == SEQUENCE_MAGIC {
        "sequence"
    } else {
        "prefix cache"
    }
}

impl SavedSequence {
    /// Writes the sequence for a session of identity `id`.
    pub fn write(&self, id: &StateIdentity, out: &mut dyn Write) -> Result<()> {
        debug_assert_eq!(self.kv.len(), self.kv_positions * id.values_per_slot);
        let mut w = HashWriter::new(out);
        w.header(SEQUENCE_MAGIC, id)?;
        w.u32(self.history_start)?;
        w.u32(self.kv_positions)?;
        for word in self.rng {
            w.u64(word)?;
        }
        w.tokens(&self.tokens)?;
        w.f32s(&self.kv)?;
        w.finish()
    }

    /// Reads a sequence of `len` bytes from `input`, checked against `id`.
    pub fn read(input: &mut dyn Read, len: u64, id: &StateIdentity) -> Result<SavedSequence> {
        let mut r = HashReader::new(input, len);
        r.header(SEQUENCE_MAGIC, id)?;
        let history_start = r.u32("the output start")?;
        let kv_positions = r.u32("the KV length")?;
        let mut rng = [0u64; 4];
        for word in &mut rng {
            *word = r.u64("the RNG state")?;
        }
        let tokens = r.tokens(id.max_tokens, id.vocab, "the token list")?;
        if tokens.is_empty() {
            return Err(corrupt("the token list is empty"));
        }
        if history_start > tokens.len() || kv_positions > tokens.len() {
            return Err(corrupt(format!(
                "output start {history_start} and KV length {kv_positions} must not exceed the {} tokens",
                tokens.len()
            )));
        }
        let kv = r.kv(kv_positions, id.values_per_slot, "the KV")?;
        r.finish()?;
        Ok(SavedSequence {
            tokens,
            history_start,
            kv_positions,
            kv,
            rng,
        })
    }
}

/// Writes a prefix cache of `count` runs for a session of identity `id`;
/// `run(i)` gives run `i` (parents before children), so the runs' KV never
/// has to be in memory all at once.
pub fn write_prefixes(
    id: &StateIdentity,
    count: usize,
    out: &mut dyn Write,
    mut run: impl FnMut(usize) -> Result<SavedRun>,
) -> Result<()> {
    let mut w = HashWriter::new(out);
    w.header(PREFIXES_MAGIC, id)?;
    w.u32(count)?;
    for i in 0..count {
        let run = run(i)?;
        debug_assert!(run.parent.is_none_or(|p| p < i));
        debug_assert_eq!(run.kv.len(), run.tokens.len() * id.values_per_slot);
        w.u32(run.parent.map_or(u32::MAX as usize, |p| p))?;
        w.u64(run.salt)?;
        w.tokens(&run.tokens)?;
        w.f32s(&run.kv)?;
    }
    w.finish()
}

/// Reads a prefix cache of `len` bytes, handing each run and its full token
/// path (its ancestors' tokens, then its own) to `visit` as it is read.
/// Only the runs' tokens are kept, never more than one run's KV. A path
/// holds at most `id.max_tokens`; the file's size bounds the rest. The
/// checksum is checked at the end, after every visit: a caller that must
/// not act on a corrupt file reads it twice, the first time visiting
/// nothing.
pub fn read_prefixes(
    input: &mut dyn Read,
    len: u64,
    id: &StateIdentity,
    mut visit: impl FnMut(&SavedRun, &[u32]) -> Result<()>,
) -> Result<usize> {
    let mut r = HashReader::new(input, len);
    r.header(PREFIXES_MAGIC, id)?;
    let n = r.u32("the run count")?;
    // Each run takes at least 20 bytes: a bound before reserving.
    r.ensure((n as u64).saturating_mul(20), "the runs")?;
    // Per run: its salt, its parent and its tokens' place in `all_tokens`;
    // paths are rebuilt by walking up, so memory stays linear in the tokens.
    let mut runs: Vec<(u64, Option<usize>, std::ops::Range<usize>)> = Vec::with_capacity(n);
    let mut all_tokens: Vec<u32> = Vec::new();
    let mut path: Vec<u32> = Vec::new();
    let mut chain: Vec<usize> = Vec::new();
    for i in 0..n {
        let parent = match r.u32("a run's parent")? {
            p if p == u32::MAX as usize => None,
            p if p < i => Some(p),
            p => return Err(corrupt(format!("run {i} names run {p} as its parent"))),
        };
        let salt = r.u64("a run's salt")?;
        if parent.is_some_and(|p| runs[p].0 != salt) {
            return Err(corrupt(format!("run {i} has another salt than its parent")));
        }
        chain.clear();
        let mut up = parent;
        while let Some(p) = up {
            chain.push(p);
            up = runs[p].1;
        }
        path.clear();
        for &c in chain.iter().rev() {
            path.extend_from_slice(&all_tokens[runs[c].2.clone()]);
        }
        let room = id.max_tokens.saturating_sub(path.len());
        let tokens = r.tokens(room, id.vocab, "a run's tokens")?;
        if tokens.is_empty() {
            return Err(corrupt(format!("run {i} is empty")));
        }
        let kv = r.kv(tokens.len(), id.values_per_slot, "a run's KV")?;
        path.extend_from_slice(&tokens);
        let start = all_tokens.len();
        all_tokens.extend_from_slice(&tokens);
        runs.push((salt, parent, start..all_tokens.len()));
        let run = SavedRun {
            parent,
            salt,
            tokens,
            kv,
        };
        visit(&run, &path)?;
    }
    r.finish()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn identity() -> StateIdentity {
        StateIdentity {
            fingerprint: 0x1234,
            kv_format: "cpu auto 16".into(),
            values_per_slot: 4,
            vocab: 100,
            max_tokens: 64,
        }
    }

    fn sequence() -> SavedSequence {
        SavedSequence {
            tokens: vec![1, 2, 3, 99],
            history_start: 2,
            kv_positions: 3,
            kv: (0..12).map(|v| v as f32 * 0.5).collect(),
            rng: [1, 2, 3, 4],
        }
    }

    fn bytes_of(s: &SavedSequence) -> Vec<u8> {
        let mut out = Vec::new();
        s.write(&identity(), &mut out).unwrap();
        out
    }

    fn read(bytes: &[u8], id: &StateIdentity) -> Result<SavedSequence> {
        SavedSequence::read(&mut &bytes[..], bytes.len() as u64, id)
    }

    #[test]
    fn a_sequence_reads_back_as_written() {
        let s = sequence();
        assert_eq!(read(&bytes_of(&s), &identity()).unwrap(), s);
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_refused() {
        let bytes = bytes_of(&sequence());
        for cut in 0..bytes.len() {
            let e = read(&bytes[..cut], &identity()).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "cut at {cut}: {e}");
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                read(&bad, &identity()).is_err(),
                "flipped byte {i} accepted"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(read(&longer, &identity()).is_err());
    }

    #[test]
    fn foreign_state_names_what_differs() {
        let bytes = bytes_of(&sequence());
        let other_model = StateIdentity {
            fingerprint: 0x9999,
            ..identity()
        };
        let e = read(&bytes, &other_model).unwrap_err();
        assert!(e.message.contains("another model"), "{e}");
        let other_kv = StateIdentity {
            kv_format: "cuda fp8 8".into(),
            ..identity()
        };
        let e = read(&bytes, &other_kv).unwrap_err();
        assert!(e.message.contains("cuda fp8 8"), "{e}");
        let small = StateIdentity {
            max_tokens: 3,
            ..identity()
        };
        let e = read(&bytes, &small).unwrap_err();
        assert!(e.message.contains("more than the 3"), "{e}");
        let e = read_prefixes(&mut &bytes[..], bytes.len() as u64, &identity(), |_, _| {
            Ok(())
        })
        .unwrap_err();
        assert!(e.message.contains("not a saved prefix cache"), "{e}");
    }

    #[test]
    fn huge_declared_sizes_fail_before_allocating() {
        let mut bytes = bytes_of(&sequence());
        // The token count sits after the header (8 + 16 + 2 + 11 + 4 bytes),
        // the output start, the KV length and the RNG state.
        let at = 8 + 16 + 2 + 11 + 4 + 4 + 4 + 32;
        bytes[at..at + 4].copy_from_slice(&60u32.to_le_bytes());
        let e = read(&bytes, &identity()).unwrap_err();
        assert!(e.message.contains("remain"), "{e}");
        let kv_at = 8 + 16 + 2 + 11 + 4 + 4;
        let mut bytes = bytes_of(&sequence());
        bytes[kv_at..kv_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read(&bytes, &identity()).is_err());
    }

    #[test]
    fn non_finite_kv_is_refused() {
        let mut s = sequence();
        s.kv[5] = f32::NAN;
        let e = read(&bytes_of(&s), &identity()).unwrap_err();
        assert!(e.message.contains("non-finite"), "{e}");
    }

    #[test]
    fn prefix_forests_read_back_with_their_paths() {
        let id = identity();
        let runs = [
            SavedRun {
                parent: None,
                salt: 7,
                tokens: vec![1, 2],
                kv: vec![0.0; 8],
            },
            SavedRun {
                parent: Some(0),
                salt: 7,
                tokens: vec![3],
                kv: vec![1.0; 4],
            },
        ];
        let mut bytes = Vec::new();
        write_prefixes(&id, runs.len(), &mut bytes, |i| Ok(runs[i].clone())).unwrap();
        let mut seen = Vec::new();
        let n = read_prefixes(&mut &bytes[..], bytes.len() as u64, &id, |run, path| {
            seen.push((run.clone(), path.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen[0], (runs[0].clone(), vec![1, 2]));
        assert_eq!(seen[1], (runs[1].clone(), vec![1, 2, 3]));
        for cut in 0..bytes.len() {
            let read = read_prefixes(&mut &bytes[..cut], cut as u64, &id, |_, _| Ok(()));
            assert!(read.is_err(), "cut at {cut} accepted");
        }
        let e = read(&bytes, &id).unwrap_err();
        assert!(e.message.contains("not a saved sequence"), "{e}");
    }
}
