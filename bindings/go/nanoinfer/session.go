package nanoinfer

/*
#include <stdlib.h>
#include <nanoinfer.h>
*/
import "C"

import (
	"context"
	"errors"
	"iter"
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// KVBackend selects the KV cache manager.
type KVBackend int

const (
	KVPaged KVBackend = C.NI_KV_BACKEND_PAGED // vLLM-style blocks (default)
	KVToken KVBackend = C.NI_KV_BACKEND_TOKEN // SGLang-style token pool
)

// SchedulePolicy selects who runs first.
type SchedulePolicy int

const (
	FCFS     SchedulePolicy = C.NI_SCHEDULE_FCFS     // first come, first served (default)
	Priority SchedulePolicy = C.NI_SCHEDULE_PRIORITY // lower Request.Priority first, with aging
)

// Preemption selects what happens to a running request when KV runs out.
type Preemption int

const (
	PreemptRecompute Preemption = C.NI_PREEMPTION_RECOMPUTE // default
	PreemptSwap      Preemption = C.NI_PREEMPTION_SWAP
)

// SpeculativeMethod selects speculative decoding: requests draft a few
// tokens that the next step verifies, keeping those the target's own
// sampling agrees with. Greedy output is identical to decoding without it;
// sampled output has the same distribution (a seeded request draws the
// same tokens).
type SpeculativeMethod int

const (
	SpeculateNone  SpeculativeMethod = C.NI_SPECULATIVE_NONE  // default
	SpeculateNgram SpeculativeMethod = C.NI_SPECULATIVE_NGRAM // prompt lookup: no extra model
	SpeculateDraft SpeculativeMethod = C.NI_SPECULATIVE_DRAFT // a draft model (SessionOptions.DraftModel)
)

// KVCacheDType selects what the KV cache stores.
type KVCacheDType int

const (
	KVCacheAuto KVCacheDType = C.NI_KV_CACHE_DTYPE_AUTO // the activation dtype (default)
	KVCacheFP8  KVCacheDType = C.NI_KV_CACHE_DTYPE_FP8  // FP8 e4m3, CUDA only: twice the tokens per byte
)

// MemoryPool selects where a session's temporaries (and, on a GPU, its KV
// cache) come from.
type MemoryPool int

const (
	MemoryPoolDefault    MemoryPool = C.NI_MEMORY_POOL_DEFAULT     // CPU arena, or the CUDA stream pool
	MemoryPoolSystem     MemoryPool = C.NI_MEMORY_POOL_SYSTEM      // the system allocator (baseline)
	MemoryPoolCPUArena   MemoryPool = C.NI_MEMORY_POOL_CPU_ARENA   // one region sized up front
	MemoryPoolCPUSlab    MemoryPool = C.NI_MEMORY_POOL_CPU_SLAB    // size classes with free lists
	MemoryPoolCUDAStream MemoryPool = C.NI_MEMORY_POOL_CUDA_STREAM // a stream-ordered CUDA pool
	MemoryPoolCUDABuddy  MemoryPool = C.NI_MEMORY_POOL_CUDA_BUDDY  // a buddy allocator over one allocation
)

// BudgetSource says how a session's KV capacity was chosen.
type BudgetSource int

const (
	BudgetAutomatic   BudgetSource = C.NI_BUDGET_AUTOMATIC
	BudgetTokens      BudgetSource = C.NI_BUDGET_TOKENS
	BudgetBytes       BudgetSource = C.NI_BUDGET_BYTES
	BudgetUtilization BudgetSource = C.NI_BUDGET_UTILIZATION
)

// SessionOptions shapes a session. Zero fields keep the library defaults
// (paged KV, 16-token blocks, automatic KV budget, a step budget of 512
// tokens and 64 sequences on the CPU or 8192 and 256 on a GPU, prefill
// chunks as large as the step budget, FCFS, prefix caching on).
// KV capacity comes from the first non-zero of KVCapacityTokens,
// KVMemoryBytes, KVMemoryFraction, MemoryUtilization.
type SessionOptions struct {
	MemoryPool MemoryPool
	// MemoryUtilization in (0, 1]: the KV cache gets this fraction of the
	// device's memory minus the weights and the step workspace (vLLM's
	// gpu_memory_utilization; on the CPU never more than is available).
	MemoryUtilization    float32
	KVBackend            KVBackend
	BlockSize            int
	KVCapacityTokens     int
	KVMemoryBytes        int64
	KVMemoryFraction     float32
	MaxBatchedTokens     int
	MaxSeqs              int
	PrefillChunkSize     int
	Policy               SchedulePolicy
	AgingSteps           int
	DisablePrefixCaching bool
	Preemption           Preemption
	Seed                 uint64 // seeds requests without their own Seed
	KVCacheDType         KVCacheDType

	// Speculative decoding. DraftModel (for SpeculateDraft) must share the
	// model's tokenizer and device; the session keeps its own reference.
	// NumSpeculativeTokens is the most tokens a request drafts per step
	// (1-16, 0 = 4); SpeculativeMaxBatch stops drafting in steps with more
	// running requests (0 = 4, the measured crossover); NgramMin/NgramMax are
	// the n-gram lengths prompt lookup tries (0 = 2 and 4).
	Speculative          SpeculativeMethod
	DraftModel           *Model
	NumSpeculativeTokens int
	SpeculativeMaxBatch  int
	NgramMin, NgramMax   int
}

// Request is one generation request. Set one of Prompt (token ids), Text,
// or Messages (a conversation rendered with the model's chat template).
// Only Messages keeps text from users from becoming control tokens: their
// special-token text (e.g. "<|im_end|>") stays plain text while the
// template's own turn markers stay special. Text reads such text as special
// tokens unless SplitSpecialTokens is set.
// Zero values select the defaults: greedy decoding (Temperature 0) of up
// to 256 tokens (MaxTokens 0), TopP and RepetitionPenalty off (0 means 1).
type Request struct {
	Prompt            []uint32
	Text              string
	AddSpecialTokens  bool // tokenize Text with BOS etc.; not for chat-templated text
	MaxTokens         int
	MinTokens         int
	Temperature       float32
	TopK              int
	TopP              float32
	MinP              float32
	RepetitionPenalty float32
	PresencePenalty   float32
	FrequencyPenalty  float32
	LogitBias         map[uint32]float32
	Seed              *uint64 // own reproducible stream; nil = from the session seed
	StopTokenIDs      []uint32
	StopStrings       []string
	IgnoreEOS         bool
	Logprobs          int // top alternatives per token (0-20); 0 = no logprobs
	Priority          int32
	CacheSalt         uint64

	// SplitSpecialTokens tokenizes special-token text in Text as ordinary
	// text (parse_special = false): set it for raw user text. Left false,
	// Text from ApplyChatTemplate keeps its turn markers, and so can any
	// user text pasted into it.
	SplitSpecialTokens bool

	// Messages is the prompt as a conversation, rendered with the model's
	// chat template with its text protected (as TokenizeChat does).
	Messages []ChatMessage

	// Structured output, at most one of them: the output is JSON matching
	// JSONSchema, a full match of Regex, a sentence of Grammar
	// (llguidance's Lark dialect), or exactly one of Choices. A cut-off
	// output inside an unfinished structure ends FinishLengthUnfinished.
	JSONSchema string
	Regex      string
	Grammar    string
	Choices    []string
	// NoGenerationPrompt leaves the assistant turn's opening off a
	// Messages prompt (it is added by default, so that the model answers).
	NoGenerationPrompt bool
	// DisableSpeculation keeps this request from drafting tokens in a
	// speculative session.
	DisableSpeculation bool
	// RetainState keeps the request's state when it ends, so SaveState can
	// still save it (until ReleaseState). A running request can be saved
	// without it.
	RetainState bool
	// State continues a conversation saved by SaveState (in this process or
	// another, with the same model): its tokens come first, then the prompt
	// (which may be empty: the output goes on where it stopped). Its KV is
	// restored, not recomputed. With Seed set the saved random stream goes
	// on, so a seeded conversation continues exactly as if never
	// interrupted. A state of another model or corrupt in any way fails
	// with ErrInvalidArgument, naming the problem.
	State []byte
}

// RequestID identifies a request within its session.
type RequestID uint64

// FinishReason says why a request ended.
type FinishReason int

const (
	FinishNone       FinishReason = C.NI_FINISH_NONE // still running
	FinishEOS        FinishReason = C.NI_FINISH_EOS
	FinishStopToken  FinishReason = C.NI_FINISH_STOP_TOKEN
	FinishStopString FinishReason = C.NI_FINISH_STOP_STRING
	FinishLength     FinishReason = C.NI_FINISH_LENGTH
	FinishCancelled  FinishReason = C.NI_FINISH_CANCELLED
	FinishError      FinishReason = C.NI_FINISH_ERROR
	// FinishLengthUnfinished: MaxTokens ran out while a constrained request
	// (JSONSchema, Regex, Grammar, Choices) was inside an unfinished
	// structure; its output does not match the constraint.
	FinishLengthUnfinished FinishReason = C.NI_FINISH_LENGTH_UNFINISHED
)

func (f FinishReason) String() string {
	switch f {
	case FinishNone:
		return "none"
	case FinishEOS:
		return "eos"
	case FinishStopToken:
		return "stop_token"
	case FinishStopString:
		return "stop_string"
	case FinishLength:
		return "length"
	case FinishCancelled:
		return "cancelled"
	case FinishError:
		return "error"
	case FinishLengthUnfinished:
		return "length_unfinished"
	}
	return "unknown"
}

// TopLogprob is one alternative at a generated position.
type TopLogprob struct {
	Token   uint32
	Logprob float32
}

// TokenLogprob is a generated token's log-probability and top alternatives.
type TokenLogprob struct {
	Token   uint32
	Logprob float32
	Top     []TopLogprob
}

// Usage is what one request used, reported with its terminal event (see
// ni_usage in nanoinfer.h for the exact definitions).
type Usage struct {
	PromptTokens int // the prompt as tokenized (Prompt, or Text tokenized with AddSpecialTokens)
	// Prompt tokens whose KV came from the prefix cache at the request's
	// first admission instead of being computed: whole KV blocks, below
	// PromptTokens; a later preemption does not change it.
	CachedPromptTokens int
	GeneratedTokens    int           // the tokens of all of the request's events
	TimeToFirstToken   time.Duration // from AddRequest to the end of the step that returned the first token; 0 if none
	TotalTime          time.Duration // from AddRequest to the end of the step that returned the terminal event
}

// Event is what happened to one request in one step. Exactly one event per
// request has Finish != FinishNone, and it is the request's last.
type Event struct {
	RequestID       RequestID
	Tokens          []uint32 // generated this step
	Text            string   // text that became final this step
	Logprobs        []TokenLogprob
	Finish          FinishReason
	StopTokenID     uint32 // for FinishStopToken
	StopStringIndex int    // for FinishStopString, else -1
	Error           string // for FinishError
	Usage           *Usage // on the terminal event (any Finish), else nil
}

// Stats are a session's counters; KV figures are in tokens.
type Stats struct {
	Running, Waiting        int
	KVCapacityTokens        int
	KVBlockSize             int
	KVUsedTokens            int
	KVFreeTokens            int
	KVCachedTokens          int
	Steps                   uint64
	PrefillTokens           uint64
	DecodeTokens            uint64
	PrefixCacheHits         uint64
	PrefixCacheTokensReused uint64
	Preemptions             uint64
	SwappedOutTokens        uint64
	// Speculative decoding: tokens drafted and verified, drafted tokens
	// kept, and (request, step) verifications; a verifying step gives
	// 1 + SpecAcceptedTokens/SpecVerifications tokens on average.
	SpecDraftTokens    uint64
	SpecAcceptedTokens uint64
	SpecVerifications  uint64
	Memory             MemoryStats
}

// MemoryStats is how a session's memory was budgeted and is used (bytes).
type MemoryStats struct {
	BudgetSource          BudgetSource
	Pool                  MemoryPool // the pool in use (the default resolved)
	TotalBytes            uint64     // device memory in total at creation (0 = unknown)
	AvailableBytes        uint64     // device memory available at creation (0 = unknown)
	WeightsBytes          uint64
	WorkspaceBytes        uint64 // planned peak of the step workspace plus logits rows
	KVBytes               uint64
	KVBytesPerToken       uint64
	KVBlocks              uint64
	ContextTokens         uint64 // the model's context length
	MaxFullContextSeqs    uint64 // sequences of that length that fit at once
	Utilization           float32
	LimitedByAvailable    bool // a utilization budget was lowered to what was available
	WorkspaceCapacity     uint64
	WorkspacePeak         uint64
	WorkspaceSystemAllocs uint64
	WorkspaceResizes      uint64
	ProfiledPeakBytes     uint64
}

// Session runs requests over one model with continuous batching. It is safe
// for concurrent use: calls are serialized, so AddRequest or Stats from
// another goroutine wait for a running Step. Cancel never waits: it stops a
// running Step that computes the request within one layer of the model.
type Session struct {
	mu sync.Mutex
	// life guards ptr against Close for Cancel, which must not take mu
	// (a running Step holds mu).
	life    sync.RWMutex
	ptr     *C.ni_session
	out     *C.ni_step_output
	backlog []Event // events Generate stepped past that belong to other requests
	cleanup runtime.Cleanup
}

type sessionHandles struct {
	session *C.ni_session
	out     *C.ni_step_output
}

// NewSession creates a session on m and allocates its KV cache.
func NewSession(m *Model, opts *SessionOptions) (*Session, error) {
	if opts == nil {
		opts = &SessionOptions{}
	}
	var p C.ni_session_params
	C.ni_session_params_init(&p)
	check := fieldCheck{op: "NewSession"}
	p.kv_backend = C.ni_kv_backend(check.uint32("KVBackend", int(opts.KVBackend)))
	p.memory_pool = C.ni_memory_pool(check.uint32("MemoryPool", int(opts.MemoryPool)))
	setIf(&p.block_size, check.uint32("BlockSize", opts.BlockSize))
	p.kv_capacity_tokens = C.uint64_t(check.uint64("KVCapacityTokens", int64(opts.KVCapacityTokens)))
	p.kv_memory_bytes = C.uint64_t(check.uint64("KVMemoryBytes", opts.KVMemoryBytes))
	p.kv_memory_fraction = C.float(opts.KVMemoryFraction)
	p.memory_utilization = C.float(opts.MemoryUtilization)
	setIf(&p.max_batched_tokens, check.uint32("MaxBatchedTokens", opts.MaxBatchedTokens))
	setIf(&p.max_seqs, check.uint32("MaxSeqs", opts.MaxSeqs))
	setIf(&p.prefill_chunk_size, check.uint32("PrefillChunkSize", opts.PrefillChunkSize))
	p.policy = C.ni_schedule_policy(check.uint32("Policy", int(opts.Policy)))
	if opts.AgingSteps != 0 {
		p.aging_steps = C.uint64_t(check.uint64("AgingSteps", int64(opts.AgingSteps)))
	}
	p.prefix_caching = C.bool(!opts.DisablePrefixCaching)
	p.preemption = C.ni_preemption_mode(check.uint32("Preemption", int(opts.Preemption)))
	p.seed = C.uint64_t(opts.Seed)
	p.kv_cache_dtype = C.ni_kv_cache_dtype(check.uint32("KVCacheDType", int(opts.KVCacheDType)))
	p.speculative_method = C.ni_speculative_method(check.uint32("Speculative", int(opts.Speculative)))
	setIf(&p.num_speculative_tokens, check.uint32("NumSpeculativeTokens", opts.NumSpeculativeTokens))
	p.speculative_max_batch = C.uint32_t(check.uint32("SpeculativeMaxBatch", opts.SpeculativeMaxBatch))
	setIf(&p.ngram_min, check.uint32("NgramMin", opts.NgramMin))
	setIf(&p.ngram_max, check.uint32("NgramMax", opts.NgramMax))
	if check.err != nil {
		return nil, check.err
	}

	s := &Session{}
	create := func(mp *C.ni_model) error {
		return call("ni_session_create", func() C.ni_status { return C.ni_session_create(mp, &p, &s.ptr) })
	}
	err := m.with(func(mp *C.ni_model) error {
		if opts.DraftModel == nil {
			return create(mp)
		}
		// The draft's handle stays valid (its read lock held) until the
		// session holds its own reference.
		return opts.DraftModel.with(func(dp *C.ni_model) error {
			p.draft_model = dp
			return create(mp)
		})
	})
	if err != nil {
		return nil, err
	}
	if err := call("ni_step_output_create", func() C.ni_status { return C.ni_step_output_create(&s.out) }); err != nil {
		C.ni_session_free(s.ptr)
		return nil, err
	}
	s.cleanup = runtime.AddCleanup(s, func(h sessionHandles) {
		C.ni_step_output_free(h.out)
		C.ni_session_free(h.session)
	}, sessionHandles{s.ptr, s.out})
	return s, nil
}

func setIf(dst *C.uint32_t, v uint32) {
	if v != 0 {
		*dst = C.uint32_t(v)
	}
}

// Close frees the session and every request still in it. Closing twice is a no-op.
func (s *Session) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.life.Lock()
	defer s.life.Unlock()
	if s.ptr != nil {
		s.cleanup.Stop()
		C.ni_step_output_free(s.out)
		C.ni_session_free(s.ptr)
		s.ptr, s.out = nil, nil
	}
	return nil
}

// AddRequest validates and queues a request. The error names the bad
// parameter (errors.Is(err, ErrInvalidArgument)); nothing is queued then.
func (s *Session) AddRequest(req Request) (RequestID, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return 0, ErrClosed
	}
	return s.addLocked(&req)
}

func (s *Session) addLocked(req *Request) (RequestID, error) {
	var pinner runtime.Pinner
	defer pinner.Unpin()
	var p C.ni_request_params
	C.ni_request_params_init(&p)
	if len(req.Messages) > 0 {
		// With Prompt or Text also set, the library refuses the request.
		p.messages = cMessages(&pinner, req.Messages)
		p.n_messages = C.size_t(len(req.Messages))
		p.add_generation_prompt = C.bool(!req.NoGenerationPrompt)
	}
	if len(req.Prompt) > 0 {
		pinner.Pin(&req.Prompt[0])
		p.prompt_tokens = tokensPtr(req.Prompt)
		p.n_prompt_tokens = C.size_t(len(req.Prompt))
	} else if len(req.Messages) == 0 || req.Text != "" {
		text := []byte(req.Text)
		if len(text) == 0 {
			text = []byte{0} // a non-NULL pointer with length 0: an empty text prompt
		}
		pinner.Pin(&text[0])
		p.prompt_text = (*C.char)(unsafe.Pointer(&text[0]))
		p.prompt_text_len = C.size_t(len(req.Text))
	}
	p.add_special_tokens = C.bool(req.AddSpecialTokens)
	check := fieldCheck{op: "AddRequest"}
	p.parse_special = C.bool(!req.SplitSpecialTokens)

	if req.MaxTokens != 0 {
		p.max_tokens = C.uint32_t(check.uint32("MaxTokens", req.MaxTokens))
	}
	p.min_tokens = C.uint32_t(check.uint32("MinTokens", req.MinTokens))
	p.temperature = C.float(req.Temperature)
	p.top_k = C.int32_t(check.int32("TopK", req.TopK))
	if req.TopP != 0 {
		p.top_p = C.float(req.TopP)
	}
	p.min_p = C.float(req.MinP)
	if req.RepetitionPenalty != 0 {
		p.repetition_penalty = C.float(req.RepetitionPenalty)
	}
	p.presence_penalty = C.float(req.PresencePenalty)
	p.frequency_penalty = C.float(req.FrequencyPenalty)
	if len(req.LogitBias) > 0 {
		bias := make([]C.ni_logit_bias, 0, len(req.LogitBias))
		for tok, b := range req.LogitBias {
			bias = append(bias, C.ni_logit_bias{token: C.uint32_t(tok), bias: C.float(b)})
		}
		pinner.Pin(&bias[0])
		p.logit_bias = &bias[0]
		p.n_logit_bias = C.size_t(len(bias))
	}
	if req.Seed != nil {
		p.seed = C.uint64_t(*req.Seed)
		p.use_seed = true
	}
	if len(req.StopTokenIDs) > 0 {
		pinner.Pin(&req.StopTokenIDs[0])
		p.stop_token_ids = tokensPtr(req.StopTokenIDs)
		p.n_stop_token_ids = C.size_t(len(req.StopTokenIDs))
	}
	if len(req.StopStrings) > 0 {
		ptrs := make([]*C.char, len(req.StopStrings))
		for i, str := range req.StopStrings {
			ptrs[i] = pinnedCString(&pinner, str)
		}
		pinner.Pin(&ptrs[0])
		p.stop_strings = &ptrs[0]
		p.n_stop_strings = C.size_t(len(ptrs))
	}
	p.ignore_eos = C.bool(req.IgnoreEOS)
	p.logprobs = C.uint32_t(check.uint32("Logprobs", req.Logprobs))
	p.priority = C.int32_t(req.Priority)
	p.cache_salt = C.uint64_t(req.CacheSalt)
	setConstraint(&p, &pinner, &check, req)
	if check.err != nil {
		return 0, check.err
	}

	p.retain_state = C.bool(req.RetainState)
	p.disable_speculation = C.bool(req.DisableSpeculation)

	var id C.uint64_t
	if req.State != nil {
		data := req.State
		if len(data) == 0 {
			data = []byte{0} // a non-NULL pointer with length 0: refused as truncated
		}
		err := call("ni_session_restore_request", func() C.ni_status {
			return C.ni_session_restore_request(s.ptr, (*C.uint8_t)(unsafe.Pointer(&data[0])), C.size_t(len(req.State)), &p, &id)
		})
		return RequestID(id), err
	}
	err := call("ni_session_add_request", func() C.ni_status { return C.ni_session_add_request(s.ptr, &p, &id) })
	return RequestID(id), err
}

// SaveState returns the saved state of request id: its tokens, the KV of
// the positions computed so far and its sampler's position. The request is
// waiting or running, or it ended with RetainState and was not released.
// Continue it with Request.State, in any session of the same model.
func (s *Session) SaveState(id RequestID) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return nil, ErrClosed
	}
	var data *C.uint8_t
	var n C.size_t
	if err := call("ni_session_save_state", func() C.ni_status {
		return C.ni_session_save_state(s.ptr, C.uint64_t(id), &data, &n)
	}); err != nil {
		return nil, err
	}
	defer C.ni_bytes_free(data)
	return C.GoBytes(unsafe.Pointer(data), C.int(n)), nil
}

// SaveStateFile writes SaveState's bytes to path (whole or not at all).
func (s *Session) SaveStateFile(id RequestID, path string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return ErrClosed
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return call("ni_session_save_state_file", func() C.ni_status {
		return C.ni_session_save_state_file(s.ptr, C.uint64_t(id), cpath)
	})
}

// ReleaseState frees the state kept for ended request id (RetainState).
func (s *Session) ReleaseState(id RequestID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return ErrClosed
	}
	return call("ni_session_release_state", func() C.ni_status { return C.ni_session_release_state(s.ptr, C.uint64_t(id)) })
}

// SavePrefixCache writes the session's prefix cache (cached prompt prefixes
// with their KV) into directory dir and returns the number of tokens saved.
func (s *Session) SavePrefixCache(dir string) (int, error) {
	return s.prefixCache(dir, "ni_session_save_prefix_cache", func(d *C.char, n *C.size_t) C.ni_status {
		return C.ni_session_save_prefix_cache(s.ptr, d, n)
	})
}

// LoadPrefixCache warm-starts the prefix cache from a directory written by
// SavePrefixCache for the same model; it returns the number of tokens now
// cached from it. A foreign or corrupt file changes nothing.
func (s *Session) LoadPrefixCache(dir string) (int, error) {
	return s.prefixCache(dir, "ni_session_load_prefix_cache", func(d *C.char, n *C.size_t) C.ni_status {
		return C.ni_session_load_prefix_cache(s.ptr, d, n)
	})
}

func (s *Session) prefixCache(dir, op string, f func(*C.char, *C.size_t) C.ni_status) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return 0, ErrClosed
	}
	cdir := C.CString(dir)
	defer C.free(unsafe.Pointer(cdir))
	var n C.size_t
	err := call(op, func() C.ni_status { return f(cdir, &n) })
	return int(n), err
}

// setConstraint fills the structured-output fields of p from req.
func setConstraint(p *C.ni_request_params, pinner *runtime.Pinner, check *fieldCheck, req *Request) {
	set := 0
	for _, on := range []bool{req.JSONSchema != "", req.Regex != "", req.Grammar != "", len(req.Choices) > 0} {
		if on {
			set++
		}
	}
	if set > 1 {
		if check.err == nil {
			check.err = invalidArgument(check.op, "set at most one of JSONSchema, Regex, Grammar and Choices")
		}
		return
	}
	text := func(kind C.ni_constraint_kind, s string) {
		p.constraint_kind = kind
		p.constraint = pinnedCString(pinner, s)
	}
	switch {
	case req.JSONSchema != "":
		text(C.NI_CONSTRAINT_JSON_SCHEMA, req.JSONSchema)
	case req.Regex != "":
		text(C.NI_CONSTRAINT_REGEX, req.Regex)
	case req.Grammar != "":
		text(C.NI_CONSTRAINT_GRAMMAR, req.Grammar)
	case len(req.Choices) > 0:
		ptrs := make([]*C.char, len(req.Choices))
		for i, c := range req.Choices {
			ptrs[i] = pinnedCString(pinner, c)
		}
		pinner.Pin(&ptrs[0])
		p.constraint_kind = C.NI_CONSTRAINT_CHOICE
		p.choices = &ptrs[0]
		p.n_choices = C.size_t(len(ptrs))
	}
}

// Step runs one engine step and returns its events (possibly none), after
// any events Generate collected for other requests. On a GPU, steady
// decoding overlaps its steps: the next one may already be running when
// Step returns (the events are the same either way).
func (s *Session) Step() ([]Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return nil, ErrClosed
	}
	events := s.backlog
	s.backlog = nil
	more, err := s.stepLocked()
	return append(events, more...), err
}

func (s *Session) stepLocked() ([]Event, error) {
	if err := call("ni_session_step", func() C.ni_status { return C.ni_session_step(s.ptr, s.out) }); err != nil {
		return nil, err
	}
	n := int(C.ni_step_output_count(s.out))
	if n == 0 {
		return nil, nil
	}
	cevs := unsafe.Slice(C.ni_step_output_events(s.out), n)
	events := make([]Event, n)
	for i := range cevs {
		events[i] = convertEvent(&cevs[i])
	}
	return events, nil
}

func convertEvent(e *C.ni_event) Event {
	ev := Event{
		RequestID:       RequestID(e.request_id),
		Tokens:          copyTokens(e.tokens, e.n_tokens),
		Text:            C.GoStringN(e.text, C.int(e.text_len)),
		Finish:          FinishReason(e.finish_reason),
		StopTokenID:     uint32(e.stop_token_id),
		StopStringIndex: int(e.stop_string_index),
	}
	if e.error_message != nil {
		ev.Error = C.GoString(e.error_message)
	}
	if u := e.usage; u != nil {
		ev.Usage = &Usage{
			PromptTokens:       int(u.prompt_tokens),
			CachedPromptTokens: int(u.cached_prompt_tokens),
			GeneratedTokens:    int(u.generated_tokens),
			TimeToFirstToken:   time.Duration(u.time_to_first_token_ns),
			TotalTime:          time.Duration(u.total_time_ns),
		}
	}
	if e.n_logprobs > 0 {
		lps := unsafe.Slice(e.logprobs, int(e.n_logprobs))
		ev.Logprobs = make([]TokenLogprob, len(lps))
		for i, lp := range lps {
			t := TokenLogprob{Token: uint32(lp.token), Logprob: float32(lp.logprob)}
			if lp.n_top > 0 {
				for _, top := range unsafe.Slice(lp.top, int(lp.n_top)) {
					t.Top = append(t.Top, TopLogprob{Token: uint32(top.token), Logprob: float32(top.logprob)})
				}
			}
			ev.Logprobs[i] = t
		}
	}
	return ev
}

// Cancel cancels a waiting or running request; its terminal event
// (FinishCancelled) comes with the next Step, or ends the Step running now
// within one layer of the model when that Step computes the request. It
// never waits for a running Step. Unknown or finished ids fail with
// ErrInvalidArgument.
func (s *Session) Cancel(id RequestID) error {
	s.life.RLock()
	defer s.life.RUnlock()
	if s.ptr == nil {
		return ErrClosed
	}
	return call("ni_session_cancel", func() C.ni_status { return C.ni_session_cancel(s.ptr, C.uint64_t(id)) })
}

// HasWork reports whether requests still need Step (or events are pending).
func (s *Session) HasWork() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ptr != nil && (len(s.backlog) > 0 || bool(C.ni_session_has_work(s.ptr)))
}

// Stats returns the session's counters.
func (s *Session) Stats() (Stats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return Stats{}, ErrClosed
	}
	var cs C.ni_session_stats
	cs.struct_size = C.uint32_t(unsafe.Sizeof(cs))
	if err := call("ni_session_get_stats", func() C.ni_status { return C.ni_session_get_stats(s.ptr, &cs) }); err != nil {
		return Stats{}, err
	}
	return Stats{
		Running:                 int(cs.running),
		Waiting:                 int(cs.waiting),
		KVCapacityTokens:        int(cs.kv_capacity_tokens),
		KVBlockSize:             int(cs.kv_block_size),
		KVUsedTokens:            int(cs.kv_used_tokens),
		KVFreeTokens:            int(cs.kv_free_tokens),
		KVCachedTokens:          int(cs.kv_cached_tokens),
		Steps:                   uint64(cs.steps),
		PrefillTokens:           uint64(cs.prefill_tokens),
		DecodeTokens:            uint64(cs.decode_tokens),
		PrefixCacheHits:         uint64(cs.prefix_cache_hits),
		PrefixCacheTokensReused: uint64(cs.prefix_cache_tokens_reused),
		Preemptions:             uint64(cs.preemptions),
		SwappedOutTokens:        uint64(cs.swapped_out_tokens),
		SpecDraftTokens:         uint64(cs.spec_draft_tokens),
		SpecAcceptedTokens:      uint64(cs.spec_accepted_tokens),
		SpecVerifications:       uint64(cs.spec_verifications),
		Memory: MemoryStats{
			BudgetSource:          BudgetSource(cs.memory_budget_source),
			Pool:                  MemoryPool(cs.memory_pool),
			TotalBytes:            uint64(cs.memory_total_bytes),
			AvailableBytes:        uint64(cs.memory_available_bytes),
			WeightsBytes:          uint64(cs.memory_weights_bytes),
			WorkspaceBytes:        uint64(cs.memory_workspace_bytes),
			KVBytes:               uint64(cs.kv_memory_bytes),
			KVBytesPerToken:       uint64(cs.kv_bytes_per_token),
			KVBlocks:              uint64(cs.kv_blocks),
			ContextTokens:         uint64(cs.context_tokens),
			MaxFullContextSeqs:    uint64(cs.max_full_context_seqs),
			Utilization:           float32(cs.memory_utilization),
			LimitedByAvailable:    bool(cs.memory_limited_by_available),
			WorkspaceCapacity:     uint64(cs.workspace_capacity_bytes),
			WorkspacePeak:         uint64(cs.workspace_peak_bytes),
			WorkspaceSystemAllocs: uint64(cs.workspace_system_allocations),
			WorkspaceResizes:      uint64(cs.workspace_resizes),
			ProfiledPeakBytes:     uint64(cs.memory_profiled_peak_bytes),
		},
	}, nil
}

// stepFor steps until events for id appear and returns them; events of
// other requests are kept for Step.
func (s *Session) stepFor(id RequestID) ([]Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return nil, ErrClosed
	}
	for {
		var mine []Event
		rest := s.backlog[:0]
		for _, ev := range s.backlog {
			if ev.RequestID == id {
				mine = append(mine, ev)
			} else {
				rest = append(rest, ev)
			}
		}
		s.backlog = rest
		if len(mine) > 0 {
			return mine, nil
		}
		events, err := s.stepLocked()
		if err != nil {
			return nil, err
		}
		s.backlog = append(s.backlog, events...)
		if len(events) == 0 && !bool(C.ni_session_has_work(s.ptr)) {
			return nil, &Error{Status: StatusInternal, Message: "session went idle before the request finished"}
		}
	}
}

// abandon cancels id (if still active) and steps until its terminal event,
// so that it leaves the session cleanly. It returns that event, or a zero
// Event when the session could not deliver it.
func (s *Session) abandon(id RequestID) Event {
	if err := s.Cancel(id); errors.Is(err, ErrClosed) {
		return Event{}
	}
	// Any other failure means it already ended; its terminal event may still
	// be in the backlog or the next Step, which the loop drains.
	for {
		events, err := s.stepFor(id)
		if err != nil {
			return Event{}
		}
		for _, ev := range events {
			if ev.Finish != FinishNone {
				return ev
			}
		}
	}
}

// Generate adds req and streams its events until the terminal one,
// stepping the session (other requests in it advance too; their events are
// returned by the next Step). A failed AddRequest or Step is yielded as an
// error. When ctx is done, or the loop stops early, the request is
// cancelled; for ctx the last pair is its terminal event (FinishCancelled,
// with its Usage) and ctx.Err(). A ctx that ends during a Step stops that
// Step within one layer of the model, so a deadline also bounds a long
// prompt's prefill.
func (s *Session) Generate(ctx context.Context, req Request) iter.Seq2[Event, error] {
	return func(yield func(Event, error) bool) {
		id, err := s.AddRequest(req)
		if err != nil {
			yield(Event{}, err)
			return
		}
		finished := false
		defer func() {
			if !finished {
				s.abandon(id)
			}
		}()
		// Cancels from the goroutine context.AfterFunc starts, so a Step
		// that is running when ctx ends stops at once.
		stopWatching := context.AfterFunc(ctx, func() { _ = s.Cancel(id) })
		defer stopWatching()
		for {
			if err := ctx.Err(); err != nil {
				last := s.abandon(id)
				finished = true
				if last.Finish == FinishNone {
					last = Event{RequestID: id, Finish: FinishCancelled, StopStringIndex: -1}
				}
				yield(last, err)
				return
			}
			events, err := s.stepFor(id)
			if err != nil {
				yield(Event{}, err)
				return
			}
			for _, ev := range events {
				var evErr error
				if ev.Finish != FinishNone {
					finished = true
					if ev.Finish == FinishCancelled {
						evErr = ctx.Err()
					}
				}
				if !yield(ev, evErr) || finished {
					return
				}
			}
		}
	}
}
