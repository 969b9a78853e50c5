import CNanoInfer
import Foundation

public enum KVBackend: UInt32 { case paged = 0, token }
public enum SchedulePolicy: UInt32 { case fcfs = 0, priority }
public enum Preemption: UInt32 { case recompute = 0, swap }
/// What the KV cache stores: the activation dtype, or FP8 e4m3 (CUDA only).
public enum KVCacheDType: UInt32 { case auto = 0, fp8 }
/// Speculative decoding: requests draft tokens the next step verifies.
/// Greedy output is unchanged; sampled output keeps its distribution.
public enum SpeculativeMethod: UInt32 { case none = 0, ngram, draft }
/// Where a session's temporaries (and, on a GPU, its KV cache) come from.
public enum MemoryPool: UInt32 { case deviceDefault = 0, system, cpuArena, cpuSlab, cudaStream, cudaBuddy }

/// Shape of a session; nil / zero fields keep the library defaults.
public struct SessionOptions {
    public var kvBackend: KVBackend = .paged
    public var blockSize: Int = 0
    public var kvCapacityTokens: Int = 0
    public var kvMemoryBytes: UInt64 = 0
    public var kvMemoryFraction: Float = 0
    public var maxBatchedTokens: Int = 0
    public var maxSeqs: Int = 0
    public var prefillChunkSize: Int = 0
    public var policy: SchedulePolicy = .fcfs
    public var agingSteps: Int = 0
    public var prefixCaching: Bool = true
    public var preemption: Preemption = .recompute
    public var seed: UInt64 = 0
    public var kvCacheDType: KVCacheDType = .auto
    public var memoryPool: MemoryPool = .deviceDefault
    /// In (0, 1]: the KV cache gets this fraction of the device's memory minus
    /// the weights and the step workspace (vLLM's gpu_memory_utilization).
    public var memoryUtilization: Float = 0
    /// Speculative decoding. `draftModel` (for `.draft`) must share the
    /// model's tokenizer and device; `numSpeculativeTokens` is the most
    /// tokens a request drafts per step (1-16, 0 = 4); drafting stops in
    /// steps with more than `speculativeMaxBatch` running requests (0 = the
    /// measured crossover, 4); `ngramMin`/`ngramMax` are the n-gram lengths
    /// prompt lookup tries (0 = 2 and 4).
    public var speculative: SpeculativeMethod = .none
    public var draftModel: Model? = nil
    public var numSpeculativeTokens: Int = 0
    public var speculativeMaxBatch: Int = 0
    public var ngramMin: Int = 0
    public var ngramMax: Int = 0

    public init(kvCapacityTokens: Int = 0) { self.kvCapacityTokens = kvCapacityTokens }
}

/// One generation request: set `prompt` (token ids), `text`, or `messages`
/// (a conversation rendered with the model's chat template). Only `messages`
/// keeps text from users from becoming control tokens: special-token text in
/// them stays plain text. `text` reads such text as special tokens unless
/// `parseSpecial` is false. Defaults match the library's: greedy, up to 256
/// tokens, every filter off.
public struct Request {
    public var prompt: [UInt32] = []
    public var text: String = ""
    public var addSpecialTokens = false
    /// Read special-token text in `text` as special tokens (true, the default,
    /// suits text from `applyChatTemplate`); false for raw user text.
    public var parseSpecial = true
    public var messages: [ChatMessage] = []
    /// With `messages`: end the prompt with the assistant turn's opening.
    public var addGenerationPrompt = true
    public var maxTokens = 256
    public var minTokens = 0
    public var temperature: Float = 0
    public var topK = 0
    public var topP: Float = 1
    public var minP: Float = 0
    public var repetitionPenalty: Float = 1
    public var presencePenalty: Float = 0
    public var frequencyPenalty: Float = 0
    public var logitBias: [UInt32: Float] = [:]
    public var seed: UInt64?
    public var stopTokenIDs: [UInt32] = []
    public var stopStrings: [String] = []
    public var ignoreEOS = false
    public var logprobs = 0
    public var priority: Int32 = 0
    public var cacheSalt: UInt64 = 0
    /// Structured output, at most one of them: JSON matching `jsonSchema`,
    /// a full match of `regex`, a sentence of `grammar` (llguidance's Lark
    /// dialect), or exactly one of `choices`. A request cut by `maxTokens`
    /// inside an unfinished structure ends `.lengthUnfinished`.
    public var jsonSchema = ""
    public var regex = ""
    public var grammar = ""
    public var choices: [String] = []
    /// Keep the request's state when it ends, so `saveState` can still
    /// save it (until `releaseState`). A running request saves without it.
    public var retainState = false
    /// Never draft tokens for this request in a speculative session.
    public var disableSpeculation = false
    /// A conversation saved by `saveState` (this process or another, same
    /// model) that this request continues: its tokens, then the prompt
    /// (which may be empty). Its KV is restored, not recomputed; with a
    /// seed the saved random stream goes on.
    public var state: [UInt8]? = nil

    public init(prompt: [UInt32] = [], text: String = "", maxTokens: Int = 256) {
        self.prompt = prompt
        self.text = text
        self.maxTokens = maxTokens
    }

    public init(messages: [ChatMessage], maxTokens: Int = 256) {
        self.messages = messages
        self.maxTokens = maxTokens
    }
}

public typealias RequestID = UInt64

public enum FinishReason: UInt32 {
    case none = 0, eos, stopToken, stopString, length, cancelled, error
    /// `maxTokens` ran out inside an unfinished structure of the request's
    /// constraint: the output does not match it.
    case lengthUnfinished
}

public struct TokenLogprob {
    public let token: UInt32
    public let logprob: Float
    public let top: [(token: UInt32, logprob: Float)]
}

/// What one request used, reported with its terminal event (see `ni_usage`
/// in nanoinfer.h for the exact definitions).
public struct Usage {
    public let promptTokens: Int
    /// Prompt tokens whose KV came from the prefix cache at the first admission.
    public let cachedPromptTokens: Int
    public let generatedTokens: Int
    /// From `addRequest` to the end of the step that returned the first token; 0 if none.
    public let timeToFirstTokenNs: UInt64
    /// From `addRequest` to the end of the step that returned the terminal event.
    public let totalTimeNs: UInt64
}

/// What happened to one request in one step; exactly one event per request
/// has `finish != .none`, and it is its last.
public struct Event {
    public let requestID: RequestID
    public let tokens: [UInt32]
    public let text: String
    public let logprobs: [TokenLogprob]
    public let finish: FinishReason
    public let stopTokenID: UInt32
    public let stopStringIndex: Int
    public let errorMessage: String?
    /// Set on the terminal event only.
    public let usage: Usage?
}

public struct SessionStats {
    public let running: Int, waiting: Int
    public let kvCapacityTokens: Int, kvBlockSize: Int
    public let kvUsedTokens: Int, kvFreeTokens: Int, kvCachedTokens: Int
    public let steps: UInt64, prefillTokens: UInt64, decodeTokens: UInt64
    public let prefixCacheHits: UInt64, prefixCacheTokensReused: UInt64
    public let preemptions: UInt64, swappedOutTokens: UInt64
    /// Tokens drafted, drafted tokens kept, and (request, step) verifications.
    public let specDraftTokens: UInt64, specAcceptedTokens: UInt64, specVerifications: UInt64
}

/// A serving session (continuous batching over one model). Calls are
/// serialized, so `addRequest` and `stats` from other threads wait for a
/// running `step`; `cancel` never waits (it stops a running step that
/// computes the request within one layer of the model).
public final class Session: @unchecked Sendable {
    private let handle: OpaquePointer
    private let output: OpaquePointer
    private let lock = NSLock()
    /// Events `generate` stepped past that belong to other requests.
    private var backlog: [Event] = []

    public init(model: Model, options: SessionOptions = SessionOptions()) throws {
        var p = ni_session_params()
        ni_session_params_init(&p)
        p.kv_backend = ni_kv_backend(options.kvBackend.rawValue)
        let op = "ni_session_create"
        if options.blockSize != 0 { p.block_size = try cUInt32(options.blockSize, "blockSize", op) }
        p.kv_capacity_tokens = try cUInt64(options.kvCapacityTokens, "kvCapacityTokens", op)
        p.kv_memory_bytes = options.kvMemoryBytes
        p.kv_memory_fraction = options.kvMemoryFraction
        p.memory_pool = ni_memory_pool(options.memoryPool.rawValue)
        p.memory_utilization = options.memoryUtilization
        if options.maxBatchedTokens != 0 {
            p.max_batched_tokens = try cUInt32(options.maxBatchedTokens, "maxBatchedTokens", op)
        }
        if options.maxSeqs != 0 { p.max_seqs = try cUInt32(options.maxSeqs, "maxSeqs", op) }
        if options.prefillChunkSize != 0 {
            p.prefill_chunk_size = try cUInt32(options.prefillChunkSize, "prefillChunkSize", op)
        }
        p.policy = ni_schedule_policy(options.policy.rawValue)
        if options.agingSteps != 0 { p.aging_steps = try cUInt64(options.agingSteps, "agingSteps", op) }
        p.prefix_caching = options.prefixCaching
        p.preemption = ni_preemption_mode(options.preemption.rawValue)
        p.seed = options.seed
        p.kv_cache_dtype = ni_kv_cache_dtype(options.kvCacheDType.rawValue)
        p.speculative_method = ni_speculative_method(options.speculative.rawValue)
        if options.numSpeculativeTokens != 0 {
            p.num_speculative_tokens = try cUInt32(options.numSpeculativeTokens, "numSpeculativeTokens", op)
        }
        p.speculative_max_batch = try cUInt32(options.speculativeMaxBatch, "speculativeMaxBatch", op)
        if options.ngramMin != 0 { p.ngram_min = try cUInt32(options.ngramMin, "ngramMin", op) }
        if options.ngramMax != 0 { p.ngram_max = try cUInt32(options.ngramMax, "ngramMax", op) }
        var s: OpaquePointer?
        // The session takes its own reference to the draft model.
        try withExtendedLifetime(options.draftModel) {
            p.draft_model = options.draftModel?.handle
            try check("ni_session_create", ni_session_create(model.handle, &p, &s))
        }
        var out: OpaquePointer?
        let st = ni_step_output_create(&out)
        if st != ni_status(NI_OK) {
            ni_session_free(s)
            try check("ni_step_output_create", st)
        }
        handle = s!
        output = out!
    }

    deinit {
        ni_step_output_free(output)
        ni_session_free(handle)
    }

    /// Validates and queues a request; the error names a bad parameter.
    public func addRequest(_ r: Request) throws -> RequestID {
        lock.lock()
        defer { lock.unlock() }
        let arena = CArena()
        var p = ni_request_params()
        ni_request_params_init(&p)
        if !r.messages.isEmpty {
            // With prompt or text also set, the library refuses the request.
            let cmsgs = r.messages.map {
                ni_chat_message(role: arena.cString($0.role), content: arena.cString($0.content))
            }
            p.messages = arena.copy(cmsgs)
            p.n_messages = cmsgs.count
            p.add_generation_prompt = r.addGenerationPrompt
        }
        if !r.prompt.isEmpty {
            p.prompt_tokens = arena.copy(r.prompt)
            p.n_prompt_tokens = r.prompt.count
        } else if r.messages.isEmpty || !r.text.isEmpty {
            p.prompt_text = arena.cString(r.text)
            p.prompt_text_len = r.text.utf8.count
        }
        p.add_special_tokens = r.addSpecialTokens
        p.parse_special = r.parseSpecial
        p.max_tokens = try cUInt32(r.maxTokens, "maxTokens", "ni_session_add_request")
        p.min_tokens = try cUInt32(r.minTokens, "minTokens", "ni_session_add_request")
        p.temperature = r.temperature
        p.top_k = Int32(clamping: r.topK)
        p.top_p = r.topP
        p.min_p = r.minP
        p.repetition_penalty = r.repetitionPenalty
        p.presence_penalty = r.presencePenalty
        p.frequency_penalty = r.frequencyPenalty
        let bias = r.logitBias.map { ni_logit_bias(token: $0.key, bias: $0.value) }
        p.logit_bias = arena.copy(bias)
        p.n_logit_bias = bias.count
        if let seed = r.seed {
            p.seed = seed
            p.use_seed = true
        }
        p.stop_token_ids = arena.copy(r.stopTokenIDs)
        p.n_stop_token_ids = r.stopTokenIDs.count
        let stops: [UnsafePointer<CChar>?] = r.stopStrings.map { arena.cString($0) }
        p.stop_strings = arena.copy(stops)
        p.n_stop_strings = stops.count
        p.ignore_eos = r.ignoreEOS
        p.logprobs = try cUInt32(r.logprobs, "logprobs", "ni_session_add_request")
        p.priority = r.priority
        p.cache_salt = r.cacheSalt
        let texts: [(ni_constraint_kind, String)] = [
            (ni_constraint_kind(NI_CONSTRAINT_JSON_SCHEMA), r.jsonSchema),
            (ni_constraint_kind(NI_CONSTRAINT_REGEX), r.regex),
            (ni_constraint_kind(NI_CONSTRAINT_GRAMMAR), r.grammar),
        ].filter { !$0.1.isEmpty }
        if texts.count + (r.choices.isEmpty ? 0 : 1) > 1 {
            throw NanoInferError(code: .invalidArgument, operation: "ni_session_add_request",
                                 message: "set at most one of jsonSchema, regex, grammar and choices")
        }
        if let (kind, text) = texts.first {
            p.constraint_kind = kind
            p.constraint = arena.cString(text)
        } else if !r.choices.isEmpty {
            let ptrs: [UnsafePointer<CChar>?] = r.choices.map { arena.cString($0) }
            p.constraint_kind = ni_constraint_kind(NI_CONSTRAINT_CHOICE)
            p.choices = arena.copy(ptrs)
            p.n_choices = ptrs.count
        }
        p.retain_state = r.retainState
        p.disable_speculation = r.disableSpeculation
        var id: UInt64 = 0
        try withExtendedLifetime(arena) {
            if let state = r.state {
                try state.withUnsafeBufferPointer { buf in
                    try check("ni_session_restore_request",
                              ni_session_restore_request(handle, buf.baseAddress, buf.count, &p, &id))
                }
            } else {
                try check("ni_session_add_request", ni_session_add_request(handle, &p, &id))
            }
        }
        return id
    }

    /// The saved state of request `id` (waiting, running, or ended with
    /// `retainState` and not released); continue it with `Request.state`.
    public func saveState(_ id: RequestID) throws -> [UInt8] {
        lock.lock()
        defer { lock.unlock() }
        var data: UnsafeMutablePointer<UInt8>? = nil
        var n = 0
        try check("ni_session_save_state", ni_session_save_state(handle, id, &data, &n))
        defer { ni_bytes_free(data) }
        return Array(UnsafeBufferPointer(start: data, count: n))
    }

    /// Frees the state kept for ended request `id` (`retainState`).
    public func releaseState(_ id: RequestID) throws {
        lock.lock()
        defer { lock.unlock() }
        try check("ni_session_release_state", ni_session_release_state(handle, id))
    }

    /// Writes the prefix cache into directory `dir`; returns the tokens saved.
    public func savePrefixCache(_ dir: String) throws -> Int {
        lock.lock()
        defer { lock.unlock() }
        var n = 0
        try check("ni_session_save_prefix_cache", ni_session_save_prefix_cache(handle, dir, &n))
        return n
    }

    /// Warm-starts the prefix cache from `dir` (same model); returns the
    /// tokens now cached from it. A foreign or corrupt file changes nothing.
    public func loadPrefixCache(_ dir: String) throws -> Int {
        lock.lock()
        defer { lock.unlock() }
        var n = 0
        try check("ni_session_load_prefix_cache", ni_session_load_prefix_cache(handle, dir, &n))
        return n
    }

    /// Runs one engine step; returns its events (after any collected by `generate`).
    /// On a GPU, steady decoding overlaps its steps: the next one may already
    /// be running when this returns (the events are the same either way).
    public func step() throws -> [Event] {
        lock.lock()
        defer { lock.unlock() }
        let events = backlog
        backlog = []
        return events + (try stepLocked())
    }

    private func stepLocked() throws -> [Event] {
        try check("ni_session_step", ni_session_step(handle, output))
        let n = ni_step_output_count(output)
        guard n > 0, let evs = ni_step_output_events(output) else { return [] }
        return (0..<n).map { Session.convert(evs[$0]) }
    }

    private static func convert(_ e: ni_event) -> Event {
        var lps: [TokenLogprob] = []
        for i in 0..<e.n_logprobs {
            let l = e.logprobs[i]
            let top = (0..<l.n_top).map { (token: l.top[$0].token, logprob: l.top[$0].logprob) }
            lps.append(TokenLogprob(token: l.token, logprob: l.logprob, top: top))
        }
        return Event(
            requestID: e.request_id,
            tokens: tokens(e.tokens, count: e.n_tokens),
            text: string(e.text, count: e.text_len),
            logprobs: lps,
            finish: FinishReason(rawValue: e.finish_reason) ?? .error,
            stopTokenID: e.stop_token_id,
            stopStringIndex: Int(e.stop_string_index),
            errorMessage: e.error_message.map { String(cString: $0) },
            usage: e.usage.map {
                Usage(
                    promptTokens: Int($0.pointee.prompt_tokens),
                    cachedPromptTokens: Int($0.pointee.cached_prompt_tokens),
                    generatedTokens: Int($0.pointee.generated_tokens),
                    timeToFirstTokenNs: $0.pointee.time_to_first_token_ns,
                    totalTimeNs: $0.pointee.total_time_ns)
            })
    }

    /// Cancels a waiting or running request; its terminal event comes with
    /// the next step, or ends the step running now. Never waits for a step
    /// (`ni_session_cancel` needs no lock), so it takes none here either.
    public func cancel(_ id: RequestID) throws {
        try check("ni_session_cancel", ni_session_cancel(handle, id))
    }

    public var hasWork: Bool {
        lock.lock()
        defer { lock.unlock() }
        return !backlog.isEmpty || ni_session_has_work(handle)
    }

    public func stats() throws -> SessionStats {
        lock.lock()
        defer { lock.unlock() }
        var s = ni_session_stats()
        s.struct_size = UInt32(MemoryLayout<ni_session_stats>.size)
        try check("ni_session_get_stats", ni_session_get_stats(handle, &s))
        return SessionStats(
            running: Int(s.running), waiting: Int(s.waiting),
            kvCapacityTokens: Int(s.kv_capacity_tokens), kvBlockSize: Int(s.kv_block_size),
            kvUsedTokens: Int(s.kv_used_tokens), kvFreeTokens: Int(s.kv_free_tokens),
            kvCachedTokens: Int(s.kv_cached_tokens),
            steps: s.steps, prefillTokens: s.prefill_tokens, decodeTokens: s.decode_tokens,
            prefixCacheHits: s.prefix_cache_hits, prefixCacheTokensReused: s.prefix_cache_tokens_reused,
            preemptions: s.preemptions, swappedOutTokens: s.swapped_out_tokens,
            specDraftTokens: s.spec_draft_tokens, specAcceptedTokens: s.spec_accepted_tokens,
            specVerifications: s.spec_verifications)
    }

    /// Steps until events for `id` appear; other requests' events are kept for `step`.
    private func stepFor(_ id: RequestID) throws -> [Event] {
        lock.lock()
        defer { lock.unlock() }
        while true {
            let mine = backlog.filter { $0.requestID == id }
            if !mine.isEmpty {
                backlog.removeAll { $0.requestID == id }
                return mine
            }
            let events = try stepLocked()
            backlog.append(contentsOf: events)
            if events.isEmpty && !ni_session_has_work(handle) {
                throw NanoInferError(code: .internalError, operation: "generate",
                                     message: "session went idle before the request finished")
            }
        }
    }

    /// Adds `request` and calls `onEvent` with each of its events until the
    /// terminal one, stepping the session (other requests advance too).
    /// Returning false from `onEvent`, or throwing, cancels the request.
    public func generate(_ request: Request, onEvent: (Event) throws -> Bool) throws {
        try generate(id: try addRequest(request), onEvent: onEvent)
    }

    /// `generate` in a task: cancelling the task cancels the request at once
    /// (a running step stops within one layer), `onEvent` receives its
    /// `.cancelled` event, and this throws `CancellationError`.
    public func generate(_ request: Request, onEvent: (Event) throws -> Bool) async throws {
        let id = try addRequest(request)
        try await withTaskCancellationHandler {
            try generate(id: id, onEvent: onEvent)
        } onCancel: {
            try? self.cancel(id)
        }
        try Task.checkCancellation()
    }

    private func generate(id: RequestID, onEvent: (Event) throws -> Bool) throws {
        var finished = false
        defer {
            if !finished {
                // Leave the session clean: cancel and consume the terminal event.
                try? cancel(id)
                while let events = try? stepFor(id), !events.contains(where: { $0.finish != .none }) {}
            }
        }
        while true {
            for event in try stepFor(id) {
                if event.finish != .none { finished = true }
                if try !onEvent(event) || finished { return }
            }
        }
    }
}
