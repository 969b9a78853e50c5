//! Saving a conversation and continuing it later, in this session or in
//! another one of the same model (after a restart, in another process),
//! without recomputing its prompt; and saving the prefix cache to warm-start
//! a later session. The bytes are `state_file`'s.
//!
//! A restored conversation is a new request whose KV is waiting to be
//! copied in, as a swapped-out request's is: admission finds it room
//! within the KV budget like any other request's (evicting cached prefixes,
//! never running requests) and copies it into the slots it got.

use super::schedule::kv_to_host;
use super::{Request, Session};
use crate::backend::Device;
use crate::engine::request::{FinishReason, RequestId, RequestParams};
use crate::engine::state_file::{
    read_prefixes, write_prefixes, SavedRun, SavedSequence, StateIdentity,
};
use crate::kv::{KvCacheBackend, SeqId};
use crate::memory::try_with_capacity;
use crate::model::ForwardContext;
use crate::{bail_arg, Error, Result};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The file a saved prefix cache is kept in, inside its directory.
pub const PREFIX_CACHE_FILE: &str = "prefix_cache.nikv";

/// The sequence id prefix-cache loading registers its runs under: request
/// ids count up from 1 and never reach it.
const LOADER_SEQ: SeqId = SeqId::MAX;

/// What saving or loading a prefix cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheReport {
    /// Cached runs in the file.
    pub runs: usize,
    /// Tokens whose KV was written (saving) or is now cached (loading).
    pub tokens: usize,
    /// Loading: tokens left out because the KV cache had no room for them
    /// (or for the run they continue), or were cached already.
    pub skipped_tokens: usize,
}

impl Session {
    /// What a state file must match to be restored into this session: the
    /// model's fingerprint, the KV cache's format and this session's limits.
    pub fn state_identity(&self) -> StateIdentity {
        let c = self.model.config();
        let device = match self.model.decoder.device() {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        };
        StateIdentity {
            fingerprint: self.model.fingerprint,
            kv_format: format!(
                "{device} {} {}",
                self.params.kv_cache_dtype, self.budget.kv_bytes_per_token
            ),
            values_per_slot: self.ctx.kv_values_per_slot(),
            vocab: c.vocab_size,
            max_tokens: self.request_token_limit(),
        }
    }

    /// Writes the state of request `id` to `out`: its tokens, the KV of the
    /// positions computed so far, where its output history starts and its
    /// RNG state. `id` is active (waiting or running: call between steps),
    /// or ended with `retain_state` set and not yet released.
    pub fn save_state(&mut self, id: RequestId, out: &mut dyn Write) -> Result<()> {
        let identity = self.state_identity();
        if let Some(kept) = self.retained.get(&id) {
            return match kept {
                Ok(saved) => saved.write(&identity, out),
                Err(e) => Err(Error::new(
                    e.kind,
                    format!(
                        "the state of request {id} could not be kept when it ended: {}",
                        e.message
                    ),
                )),
            };
        }
        let Session {
            requests, kv, ctx, ..
        } = self;
        let Some(req) = requests.get(&id) else {
            bail_arg!(
                "request {id} is neither active nor retained (set retain_state to save a request after it ends)"
            );
        };
        let saved = snapshot(kv.as_ref(), ctx.as_mut(), id, req)?;
        saved.write(&identity, out)
    }

    /// [`save_state`](Session::save_state) into a byte vector.
    pub fn save_state_bytes(&mut self, id: RequestId) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.save_state(id, &mut out)?;
        Ok(out)
    }

    /// [`save_state`](Session::save_state) into the file at `path`, written
    /// whole or not at all (through a temporary file renamed into place).
    pub fn save_state_file(&mut self, id: RequestId, path: &Path) -> Result<()> {
        write_atomically(path, |out| self.save_state(id, out))
    }

    /// Queues a new request that continues the conversation saved in
    /// `input` (`len` bytes): its tokens, then `params.prompt` (which may
    /// be empty: the output goes on where it stopped). The saved KV is
    /// copied in when the request is admitted, so only the positions it
    /// lacks are computed. A seeded request (`params.sampling.seed` set)
    /// continues the saved random stream, so a continuation draws exactly
    /// what the uninterrupted request would have; an unseeded one draws a
    /// fresh stream. A file of another model, another KV format, too many
    /// tokens for this session, or corrupt in any way is refused with an
    /// error naming the problem, and nothing is queued.
    pub fn restore_request(
        &mut self,
        input: &mut dyn Read,
        len: u64,
        params: RequestParams,
    ) -> Result<RequestId> {
        let saved = SavedSequence::read(input, len, &self.state_identity())?;
        self.add_request_with(params, Instant::now(), Some(saved))
    }

    /// [`restore_request`](Session::restore_request) from bytes.
    pub fn restore_request_bytes(
        &mut self,
        state: &[u8],
        params: RequestParams,
    ) -> Result<RequestId> {
        self.restore_request(&mut &state[..], state.len() as u64, params)
    }

    /// [`restore_request`](Session::restore_request) from a file.
    pub fn restore_request_file(
        &mut self,
        path: &Path,
        params: RequestParams,
    ) -> Result<RequestId> {
        let (file, len) = open_sized(path)?;
        self.restore_request(&mut BufReader::new(file), len, params)
            .map_err(|e| in_file(path, e))
    }

    /// Frees the state kept for ended request `id` (see `retain_state`).
    pub fn release_state(&mut self, id: RequestId) -> Result<()> {
        match self.retained.remove(&id) {
            Some(_) => Ok(()),
            None => bail_arg!("no state is kept for request {id}"),
        }
    }

    /// Number of ended requests whose state is kept.
    pub fn retained_states(&self) -> usize {
        self.retained.len()
    }

    /// Keeps the state of `req`, which is ending with `reason`, when it
    /// asked for that. Called before its KV is released.
    pub(super) fn retain_if_asked(&mut self, id: RequestId, req: &Request, reason: &FinishReason) {
        if req.params.retain_state && !matches!(reason, FinishReason::Error(_)) {
            let kept = snapshot(self.kv.as_ref(), self.ctx.as_mut(), id, req);
            self.retained.insert(id, kept);
        }
    }

    /// Writes the prefix cache (every cached token reachable from a root,
    /// with its KV and cache salt) to `dir/prefix_cache.nikv`, creating
    /// `dir` if needed; the file is written whole or not at all.
    pub fn save_prefix_cache(&mut self, dir: &Path) -> Result<PrefixCacheReport> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        let runs = self.kv.cached_runs();
        let identity = self.state_identity();
        let ctx = self.ctx.as_mut();
        write_atomically(&dir.join(PREFIX_CACHE_FILE), |out| {
            write_prefixes(&identity, runs.len(), out, |i| {
                let run = &runs[i];
                let mut kv = Vec::new();
                ctx.save_kv(&run.slots, &mut kv)?;
                Ok(SavedRun {
                    parent: run.parent,
                    salt: run.salt,
                    tokens: run.tokens.clone(),
                    kv,
                })
            })
        })?;
        Ok(PrefixCacheReport {
            runs: runs.len(),
            tokens: runs.iter().map(|r| r.tokens.len()).sum(),
            skipped_tokens: 0,
        })
    }

    /// Warm-starts the prefix cache from a directory written by
    /// [`save_prefix_cache`](Session::save_prefix_cache) for the same model
    /// and KV format. The whole file is checked before anything is used;
    /// its runs then enter the cache as evictable prefixes within the KV
    /// budget (when the cache is full, the least recently used cached
    /// prefixes make room; running requests keep theirs). Call between
    /// steps.
    pub fn load_prefix_cache(&mut self, dir: &Path) -> Result<PrefixCacheReport> {
        let path = dir.join(PREFIX_CACHE_FILE);
        let identity = self.state_identity();
        let (mut file, len) = open_sized(&path)?;
        let pass = |file: &mut File, visit: &mut dyn FnMut(&SavedRun, &[u32]) -> Result<()>| {
            file.rewind().map_err(|e| Error::io(path.display(), e))?;
            read_prefixes(&mut BufReader::new(file), len, &identity, visit)
                .map_err(|e| in_file(&path, e))
        };
        // First the checks, acting on nothing; then the loading.
        pass(&mut file, &mut |_, _| Ok(()))?;
        let mut report = PrefixCacheReport::default();
        let runs = pass(&mut file, &mut |run, path| {
            let cached = self.cache_run(run, path)?;
            report.tokens += cached;
            report.skipped_tokens += run.tokens.len() - cached;
            Ok(())
        })?;
        report.runs = runs;
        Ok(report)
    }

    /// Puts `run` (whose whole token path is `path`) into the prefix cache;
    /// returns how many of its tokens it added.
    fn cache_run(&mut self, run: &SavedRun, path: &[u32]) -> Result<usize> {
        let start = path.len() - run.tokens.len();
        // `begin` leaves the last token to compute: one more makes the
        // whole path matchable.
        let mut probe = Vec::with_capacity(path.len() + 1);
        probe.extend_from_slice(path);
        probe.push(0);
        let have = self.kv.begin(LOADER_SEQ, &probe, run.salt);
        // Nothing to add, or the run it continues is not cached (it did not
        // fit): without that KV these positions cannot be used.
        if have >= path.len() || have < start || !self.kv.allocate(LOADER_SEQ, path.len()) {
            self.kv.release(LOADER_SEQ);
            return Ok(0);
        }
        let mapping = self.kv.mapping(LOADER_SEQ);
        let slots: Vec<u32> = (have..path.len()).map(|p| mapping.slot(p) as u32).collect();
        let per_slot = self.ctx.kv_values_per_slot();
        let copied = self
            .ctx
            .restore_kv(&slots, &run.kv[(have - start) * per_slot..]);
        if copied.is_ok() {
            self.kv.commit(LOADER_SEQ, path);
        }
        self.kv.release(LOADER_SEQ);
        copied.map(|()| path.len() - have)
    }
}

/// The state of request `req` (id `id`) now: the KV of its computed
/// positions (or of the ones a swap preemption saved), its tokens and its
/// sampler's position in its random stream.
fn snapshot(
    kv: &dyn KvCacheBackend,
    ctx: &mut dyn ForwardContext,
    id: RequestId,
    req: &Request,
) -> Result<SavedSequence> {
    let (kv_positions, kv) = if req.in_kv {
        let n = req.computed;
        (n, kv_to_host(kv, ctx, id, n)?)
    } else if let Some((n, data)) = &req.swapped {
        let mut copy = try_with_capacity(data.len(), "a copy of a request's swapped-out KV")?;
        copy.extend_from_slice(data);
        (*n, copy)
    } else {
        (0, Vec::new())
    };
    let mut tokens = try_with_capacity(req.tokens.len(), "a copy of a request's tokens")?;
    tokens.extend_from_slice(&req.tokens);
    Ok(SavedSequence {
        tokens,
        history_start: req.history_start,
        kv_positions,
        kv,
        rng: req.flight_rng.unwrap_or_else(|| req.sampler.rng_state()),
    })
}

/// Opens `path` for reading, with its length.
fn open_sized(path: &Path) -> Result<(File, u64)> {
    let file = File::open(path).map_err(|e| Error::io(path.display(), e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io(path.display(), e))?
        .len();
    Ok((file, len))
}

/// `e` with the file it came from named.
fn in_file(path: &Path, e: Error) -> Error {
    Error::new(e.kind, format!("{}: {}", path.display(), e.message))
}

/// Runs `write` into a temporary file beside `path`, then renames it to
/// `path`: readers see the old file or the new one, never a partial one.
fn write_atomically(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(path).with_file_name(name);
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| Error::io(tmp.display(), e))?;
        let mut out = BufWriter::new(file);
        write(&mut out)?;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(tmp.display(), e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(tmp.display(), e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path.display(), e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
