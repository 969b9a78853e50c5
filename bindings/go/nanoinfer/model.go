package nanoinfer

/*
#include <stdint.h>
#include <stdlib.h>
#include <nanoinfer.h>

extern _Bool nanoinferGoProgress(float, void *);

static void ni_go_set_progress(ni_model_params *p, uintptr_t handle) {
	p->progress = (ni_progress_callback)nanoinferGoProgress;
	p->progress_user_data = (void *)handle;
}
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// DType is the weight data type to load.
type DType int

const (
	DTypeAuto DType = C.NI_DTYPE_AUTO // the checkpoint's own (zero-copy where possible)
	DTypeF32  DType = C.NI_DTYPE_F32
	DTypeF16  DType = C.NI_DTYPE_F16
	DTypeBF16 DType = C.NI_DTYPE_BF16
)

// Quant selects online weight quantization at load time.
type Quant int

const (
	QuantNone Quant = C.NI_QUANT_NONE // keep the checkpoint's weights
	// QuantQ8_0: int8 weights with one f32 scale per QuantGroupSize inputs
	// (the CLI's --quant q8_0); embeddings and norms stay dense.
	QuantQ8_0 Quant = C.NI_QUANT_Q8_0
	// QuantAWQ: int4 AWQ round-to-nearest, scale and zero per QuantGroupSize
	// inputs (the CLI's --quant awq); runs on the CPU and CUDA int4 kernels.
	QuantAWQ Quant = C.NI_QUANT_AWQ
	// QuantGPTQ: int4 GPTQ-format symmetric round-to-nearest (--quant gptq).
	QuantGPTQ Quant = C.NI_QUANT_GPTQ
	// QuantFP8: FP8 E4M3 with one scale per 128 x 128 block (--quant fp8);
	// the CPU computes with the dequantized values, CUDA refuses it for now.
	QuantFP8 Quant = C.NI_QUANT_FP8
)

// Device selects where a model runs.
type Device int

const (
	DeviceCPU Device = C.NI_DEVICE_CPU // SIMD kernels on a thread pool (default)
	// DeviceCUDA: an NVIDIA GPU (ModelOptions.DeviceIndex picks it). The
	// driver, NVRTC and cuBLAS load at run time; without them LoadModel
	// fails with ErrUnsupported naming what is missing.
	DeviceCUDA Device = C.NI_DEVICE_CUDA
)

// ModelOptions tunes LoadModel. The zero value loads on the CPU with the
// checkpoint's dtype on all cores.
type ModelOptions struct {
	Device      Device
	DeviceIndex int // GPU ordinal; ignored on the CPU
	DType       DType
	// Threads for the CPU kernels; 0 = all cores.
	Threads int
	// Quant quantizes the dense weights at load; the zero value keeps them.
	Quant Quant
	// QuantGroupSize is the inputs per scale: for QuantQ8_0 a positive
	// multiple of 4, 0 = 32; for QuantAWQ/QuantGPTQ 32, 64 or 128, 0 = 128.
	QuantGroupSize int
	// QuantDenseLMHead keeps the LM head dense under QuantQ8_0 (by default
	// it is quantized too, as the CLI does).
	QuantDenseLMHead bool
	// Progress, if set, is called with values in [0, 1] during the load;
	// returning false cancels it (LoadModel then fails with ErrCancelled).
	Progress func(progress float32) bool
}

// Model is a loaded model. It is safe for concurrent use; sessions keep it
// alive, so it may be closed while sessions created from it are open.
type Model struct {
	mu      sync.RWMutex
	ptr     *C.ni_model
	cleanup runtime.Cleanup
}

// ModelInfo describes a loaded model.
type ModelInfo struct {
	Architecture    string // HuggingFace name, e.g. "LlamaForCausalLM"
	VocabSize       int
	ContextLength   int
	Layers          int
	HiddenSize      int
	Heads           int
	KVHeads         int
	HeadDim         int
	BOSTokenID      int // -1 when the model has none
	EOSTokenIDs     []uint32
	HasTokenizer    bool
	HasChatTemplate bool
}

// ChatMessage is one turn of a conversation.
type ChatMessage struct {
	Role    string // "system", "user", "assistant", ...
	Content string
}

// LoadModel loads a HuggingFace model directory (config.json,
// *.safetensors, tokenizer.json).
func LoadModel(path string, opts *ModelOptions) (*Model, error) {
	if opts == nil {
		opts = &ModelOptions{}
	}
	var params C.ni_model_params
	C.ni_model_params_init(&params)
	check := fieldCheck{op: "LoadModel"}
	params.device = C.ni_device(check.uint32("Device", int(opts.Device)))
	params.device_index = C.int32_t(check.int32("DeviceIndex", opts.DeviceIndex))
	params.dtype = C.ni_dtype(check.uint32("DType", int(opts.DType)))
	params.n_threads = C.uint32_t(check.uint32("Threads", opts.Threads))
	params.quant = C.ni_quant(check.uint32("Quant", int(opts.Quant)))
	params.quant_group_size = C.uint32_t(check.uint32("QuantGroupSize", opts.QuantGroupSize))
	if check.err != nil {
		return nil, check.err
	}
	params.quant_lm_head = C.bool(!opts.QuantDenseLMHead)
	var progress *progressState
	if opts.Progress != nil {
		progress = &progressState{fn: opts.Progress}
		h := cgo.NewHandle(progress)
		defer h.Delete()
		C.ni_go_set_progress(&params, C.uintptr_t(h))
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var ptr *C.ni_model
	err := call("ni_model_load", func() C.ni_status { return C.ni_model_load(cpath, &params, &ptr) })
	if progress != nil && progress.didPanic {
		if err == nil {
			C.ni_model_free(ptr)
		}
		panic(progress.panicked)
	}
	if err != nil {
		return nil, err
	}
	m := &Model{ptr: ptr}
	m.cleanup = runtime.AddCleanup(m, func(p *C.ni_model) { C.ni_model_free(p) }, ptr)
	return m, nil
}

// Close frees the model handle. Open sessions keep the weights alive until
// they are closed. Closing twice is a no-op.
func (m *Model) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ptr != nil {
		m.cleanup.Stop()
		C.ni_model_free(m.ptr)
		m.ptr = nil
	}
	return nil
}

// with runs f with the live handle under the read lock.
func (m *Model) with(f func(p *C.ni_model) error) error {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.ptr == nil {
		return ErrClosed
	}
	return f(m.ptr)
}

// Info describes the model.
func (m *Model) Info() (ModelInfo, error) {
	var info ModelInfo
	err := m.with(func(p *C.ni_model) error {
		var ci C.ni_model_info
		ci.struct_size = C.uint32_t(unsafe.Sizeof(ci))
		if err := call("ni_model_get_info", func() C.ni_status { return C.ni_model_get_info(p, &ci) }); err != nil {
			return err
		}
		info = ModelInfo{
			Architecture:    C.GoString(ci.architecture),
			VocabSize:       int(ci.vocab_size),
			ContextLength:   int(ci.context_length),
			Layers:          int(ci.n_layers),
			HiddenSize:      int(ci.hidden_size),
			Heads:           int(ci.n_heads),
			KVHeads:         int(ci.n_kv_heads),
			HeadDim:         int(ci.head_dim),
			BOSTokenID:      int(ci.bos_token_id),
			EOSTokenIDs:     copyTokens(ci.eos_token_ids, ci.n_eos_token_ids),
			HasTokenizer:    bool(ci.has_tokenizer),
			HasChatTemplate: bool(ci.has_chat_template),
		}
		return nil
	})
	return info, err
}

// Tokenize returns the token ids of text. With addSpecialTokens the
// tokenizer's post-processor tokens (e.g. BOS) are added; text from
// ApplyChatTemplate already holds them.
//
// Special-token text in text (e.g. "<|im_end|>") becomes those special
// tokens, so text a user typed can close its turn and forge others: use
// TokenizeChat for conversations and TokenizeWith for raw user text.
func (m *Model) Tokenize(text string, addSpecialTokens bool) ([]uint32, error) {
	var out []uint32
	err := m.with(func(p *C.ni_model) error {
		var toks *C.uint32_t
		var n C.size_t
		err := call("ni_tokenize", func() C.ni_status {
			// Passing Go memory without Go pointers as a call argument is allowed.
			return C.ni_tokenize(p, stringPtr(text), C.size_t(len(text)), C.bool(addSpecialTokens), &toks, &n)
		})
		if err != nil {
			return err
		}
		out = copyTokens(toks, n)
		C.ni_tokens_free(toks)
		return nil
	})
	return out, err
}

// TokenizeOptions says how TokenizeWith reads its text. The zero value is
// the safe choice for text from users.
type TokenizeOptions struct {
	// AddSpecialTokens adds the tokenizer's post-processor tokens (e.g. BOS).
	AddSpecialTokens bool
	// ParseSpecial reads special-token text (e.g. "<|im_end|>") as those
	// special tokens. When false it is tokenized as ordinary text, exactly as
	// transformers with split_special_tokens=True; added tokens that are not
	// special are matched either way.
	ParseSpecial bool
}

// TokenizeWith returns the token ids of text, read as opts say
// (ni_tokenize_ex).
func (m *Model) TokenizeWith(text string, opts TokenizeOptions) ([]uint32, error) {
	var flags C.uint32_t
	if opts.AddSpecialTokens {
		flags |= C.NI_TOKENIZE_ADD_SPECIAL
	}
	if opts.ParseSpecial {
		flags |= C.NI_TOKENIZE_PARSE_SPECIAL
	}
	var out []uint32
	err := m.with(func(p *C.ni_model) error {
		var toks *C.uint32_t
		var n C.size_t
		err := call("ni_tokenize_ex", func() C.ni_status {
			return C.ni_tokenize_ex(p, stringPtr(text), C.size_t(len(text)), flags, &toks, &n)
		})
		if err != nil {
			return err
		}
		out = copyTokens(toks, n)
		C.ni_tokens_free(toks)
		return nil
	})
	return out, err
}

// TokenizeChat renders messages with the model's chat template and returns
// the token ids, as transformers' apply_chat_template(tokenize=True) does,
// except that special-token text inside the messages stays ordinary text:
// only the template's own special tokens are special, so a message cannot
// close its turn or forge a system or assistant turn. This is the way to
// turn untrusted chat text into a prompt (or Request.Messages).
func (m *Model) TokenizeChat(messages []ChatMessage, addGenerationPrompt bool) ([]uint32, error) {
	var out []uint32
	err := m.with(func(p *C.ni_model) error {
		var pinner runtime.Pinner
		defer pinner.Unpin()
		first := cMessages(&pinner, messages)
		var toks *C.uint32_t
		var n C.size_t
		err := call("ni_tokenize_chat", func() C.ni_status {
			return C.ni_tokenize_chat(p, first, C.size_t(len(messages)), C.bool(addGenerationPrompt), &toks, &n)
		})
		if err != nil {
			return err
		}
		out = copyTokens(toks, n)
		C.ni_tokens_free(toks)
		return nil
	})
	return out, err
}

// Detokenize returns the text of token ids; with skipSpecialTokens special
// tokens are left out.
func (m *Model) Detokenize(tokens []uint32, skipSpecialTokens bool) (string, error) {
	var out string
	err := m.with(func(p *C.ni_model) error {
		var text *C.char
		var n C.size_t
		err := call("ni_detokenize", func() C.ni_status {
			return C.ni_detokenize(p, tokensPtr(tokens), C.size_t(len(tokens)), C.bool(skipSpecialTokens), &text, &n)
		})
		if err != nil {
			return err
		}
		out = C.GoStringN(text, C.int(n))
		C.ni_string_free(text)
		return nil
	})
	return out, err
}

// ApplyChatTemplate renders messages with the model's chat template, as
// transformers' apply_chat_template(tokenize=False) does. With
// addGenerationPrompt the text ends with the assistant turn's opening.
//
// Tokenizing this text reads special-token text inside the messages as
// special tokens; for untrusted messages use TokenizeChat or
// Request.Messages instead.
func (m *Model) ApplyChatTemplate(messages []ChatMessage, addGenerationPrompt bool) (string, error) {
	var out string
	err := m.with(func(p *C.ni_model) error {
		var pinner runtime.Pinner
		defer pinner.Unpin()
		first := cMessages(&pinner, messages)
		var text *C.char
		var n C.size_t
		err := call("ni_apply_chat_template", func() C.ni_status {
			return C.ni_apply_chat_template(p, first, C.size_t(len(messages)), C.bool(addGenerationPrompt), &text, &n)
		})
		if err != nil {
			return err
		}
		out = C.GoStringN(text, C.int(n))
		C.ni_string_free(text)
		return nil
	})
	return out, err
}

// cMessages copies messages into pinned C-layout messages and returns the
// first (nil when there are none); pinner must stay pinned during the call.
func cMessages(pinner *runtime.Pinner, messages []ChatMessage) *C.ni_chat_message {
	if len(messages) == 0 {
		return nil
	}
	cmsgs := make([]C.ni_chat_message, len(messages))
	for i, msg := range messages {
		cmsgs[i].role = pinnedCString(pinner, msg.Role)
		cmsgs[i].content = pinnedCString(pinner, msg.Content)
	}
	pinner.Pin(&cmsgs[0]) // Go memory holding (pinned) Go pointers
	return &cmsgs[0]
}

// stringPtr points at s's bytes (no NUL); nil for "".
func stringPtr(s string) *C.char {
	if len(s) == 0 {
		return nil
	}
	return (*C.char)(unsafe.Pointer(unsafe.StringData(s)))
}

// tokensPtr points at the first token; nil for an empty slice.
func tokensPtr(t []uint32) *C.uint32_t {
	if len(t) == 0 {
		return nil
	}
	return (*C.uint32_t)(unsafe.Pointer(&t[0]))
}

// pinnedCString returns a NUL-terminated Go copy of s, pinned so that C
// memory or pinned Go memory may point at it during the call.
func pinnedCString(p *runtime.Pinner, s string) *C.char {
	b := make([]byte, len(s)+1)
	copy(b, s)
	p.Pin(&b[0])
	return (*C.char)(unsafe.Pointer(&b[0]))
}

func copyTokens(p *C.uint32_t, n C.size_t) []uint32 {
	if n == 0 || p == nil {
		return []uint32{}
	}
	return append([]uint32(nil), unsafe.Slice((*uint32)(unsafe.Pointer(p)), int(n))...)
}
