package nanoinfer

/*
#include <stdlib.h>
#include <nanoinfer.h>
*/
import "C"

import (
	"context"
	"iter"
	"runtime"
	"sync"
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

// KVCacheDType selects what the KV cache stores.
type KVCacheDType int

const (
	KVCacheAuto KVCacheDType = C.NI_KV_CACHE_DTYPE_AUTO // the activation dtype (default)
	KVCacheFP8  KVCacheDType = C.NI_KV_CACHE_DTYPE_FP8  // FP8 e4m3, CUDA only: twice the tokens per byte
)

// SessionOptions shapes a session. Zero fields keep the library defaults
// (paged KV, 16-token blocks, automatic KV budget, a step budget of 512
// tokens and 64 sequences on the CPU or 8192 and 256 on a GPU, prefill
// chunks as large as the step budget, FCFS, prefix caching on).
// KV capacity comes from the first non-zero of KVCapacityTokens,
// KVMemoryBytes, KVMemoryFraction.
type SessionOptions struct {
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
	// NoGenerationPrompt leaves the assistant turn's opening off a
	// Messages prompt (it is added by default, so that the model answers).
	NoGenerationPrompt bool
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
}

// Session runs requests over one model with continuous batching. It is safe
// for concurrent use: calls are serialized, so Cancel or Stats from another
// goroutine wait for a running Step.
type Session struct {
	mu      sync.Mutex
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
	p.kv_backend = C.ni_kv_backend(opts.KVBackend)
	setIf(&p.block_size, opts.BlockSize)
	p.kv_capacity_tokens = C.uint64_t(opts.KVCapacityTokens)
	p.kv_memory_bytes = C.uint64_t(opts.KVMemoryBytes)
	p.kv_memory_fraction = C.float(opts.KVMemoryFraction)
	setIf(&p.max_batched_tokens, opts.MaxBatchedTokens)
	setIf(&p.max_seqs, opts.MaxSeqs)
	setIf(&p.prefill_chunk_size, opts.PrefillChunkSize)
	p.policy = C.ni_schedule_policy(opts.Policy)
	if opts.AgingSteps != 0 {
		p.aging_steps = C.uint64_t(opts.AgingSteps)
	}
	p.prefix_caching = C.bool(!opts.DisablePrefixCaching)
	p.preemption = C.ni_preemption_mode(opts.Preemption)
	p.seed = C.uint64_t(opts.Seed)
	p.kv_cache_dtype = C.ni_kv_cache_dtype(opts.KVCacheDType)

	s := &Session{}
	err := m.with(func(mp *C.ni_model) error {
		return call("ni_session_create", func() C.ni_status { return C.ni_session_create(mp, &p, &s.ptr) })
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

func setIf(dst *C.uint32_t, v int) {
	if v != 0 {
		*dst = C.uint32_t(v)
	}
}

// Close frees the session and every request still in it. Closing twice is a no-op.
func (s *Session) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
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
	p.parse_special = C.bool(!req.SplitSpecialTokens)
	if req.MaxTokens != 0 {
		p.max_tokens = C.uint32_t(req.MaxTokens)
	}
	p.min_tokens = C.uint32_t(req.MinTokens)
	p.temperature = C.float(req.Temperature)
	p.top_k = C.int32_t(req.TopK)
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
	p.logprobs = C.uint32_t(req.Logprobs)
	p.priority = C.int32_t(req.Priority)
	p.cache_salt = C.uint64_t(req.CacheSalt)

	var id C.uint64_t
	err := call("ni_session_add_request", func() C.ni_status { return C.ni_session_add_request(s.ptr, &p, &id) })
	return RequestID(id), err
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
// (FinishCancelled) comes with the next Step. Unknown or finished ids fail
// with ErrInvalidArgument.
func (s *Session) Cancel(id RequestID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return ErrClosed
	}
	return s.cancelLocked(id)
}

func (s *Session) cancelLocked(id RequestID) error {
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
// so that it leaves the session cleanly.
func (s *Session) abandon(id RequestID) {
	s.mu.Lock()
	if s.ptr == nil {
		s.mu.Unlock()
		return
	}
	_ = s.cancelLocked(id) // fails only when it already finished
	s.mu.Unlock()
	for {
		events, err := s.stepFor(id)
		if err != nil {
			return
		}
		for _, ev := range events {
			if ev.Finish != FinishNone {
				return
			}
		}
	}
}

// Generate adds req and streams its events until the terminal one,
// stepping the session (other requests in it advance too; their events are
// returned by the next Step). A failed AddRequest or Step is yielded as an
// error. When ctx is done, or the loop stops early, the request is
// cancelled; for ctx the last pair carries ctx.Err().
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
		for {
			if err := ctx.Err(); err != nil {
				s.abandon(id)
				finished = true
				yield(Event{RequestID: id, Finish: FinishCancelled, StopStringIndex: -1}, err)
				return
			}
			events, err := s.stepFor(id)
			if err != nil {
				yield(Event{}, err)
				return
			}
			for _, ev := range events {
				if ev.Finish != FinishNone {
					finished = true
				}
				if !yield(ev, nil) || finished {
					return
				}
			}
		}
	}
}
