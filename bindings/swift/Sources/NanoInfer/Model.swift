import CNanoInfer
import Foundation

public enum DType: UInt32 {
    case auto = 0, f32, f16, bf16
}

/// Where a model runs: the CPU, or an NVIDIA GPU (driver, NVRTC and cuBLAS
/// loaded at run time; without them loading throws `.unsupported`).
public enum Device: UInt32 {
    case cpu = 0, cuda
}

/// Online weight quantization at load (`NI_QUANT_*`).
public enum Quant: UInt32 {
    /// Keep the checkpoint's weights.
    case none = 0
    /// Int8 weights, one f32 scale per `quantGroupSize` inputs.
    case q8_0 = 1
    /// Int4 AWQ round-to-nearest, scale and zero per `quantGroupSize` inputs.
    case awq = 2
    /// Int4 GPTQ-format symmetric round-to-nearest.
    case gptq = 3
    /// FP8 E4M3, one scale per 128 × 128 block (LM head dense); the CPU
    /// computes with the dequantized values, CUDA refuses it for now.
    case fp8 = 4
}

public struct ModelOptions {
    public var device: Device = .cpu
    /// GPU ordinal; ignored on the CPU.
    public var deviceIndex: Int = 0
    public var dtype: DType
    /// CPU kernel threads; 0 = all cores.
    public var threads: Int
    public var quant: Quant = .none
    /// Inputs per scale: `.q8_0` a positive multiple of 4, 0 = 32; `.awq`,
    /// `.gptq` 32, 64 or 128, 0 = 128.
    public var quantGroupSize: Int = 0
    /// Quantize the LM head too under `.q8_0` (the default, as the CLI does).
    public var quantLMHead: Bool = true
    /// Called with values in [0, 1] while loading; return false to cancel.
    public var progress: ((Float) -> Bool)?

    public init(dtype: DType = .auto, threads: Int = 0, progress: ((Float) -> Bool)? = nil) {
        self.dtype = dtype
        self.threads = threads
        self.progress = progress
    }
}

public struct ChatMessage {
    public var role: String
    public var content: String
    public init(role: String, content: String) {
        self.role = role
        self.content = content
    }
}

/// How `tokenize(_:options:)` reads its text. The defaults are the safe
/// choice for text from users.
public struct TokenizeOptions {
    /// Add the tokenizer's post-processor tokens (e.g. BOS).
    public var addSpecialTokens = false
    /// Read special-token text (e.g. "<|im_end|>") as those special tokens;
    /// when false it is tokenized as ordinary text (transformers'
    /// split_special_tokens=True).
    public var parseSpecial = false
    public init(addSpecialTokens: Bool = false, parseSpecial: Bool = false) {
        self.addSpecialTokens = addSpecialTokens
        self.parseSpecial = parseSpecial
    }
}

public struct ModelInfo {
    public let architecture: String
    public let vocabSize: Int
    public let contextLength: Int
    public let layers: Int
    public let hiddenSize: Int
    public let heads: Int
    public let kvHeads: Int
    public let headDim: Int
    /// -1 when the model has none.
    public let bosTokenID: Int
    public let eosTokenIDs: [UInt32]
    public let hasTokenizer: Bool
    public let hasChatTemplate: Bool
}

private final class ProgressBox {
    let fn: (Float) -> Bool
    init(_ fn: @escaping (Float) -> Bool) { self.fn = fn }
}

/// A loaded model. Immutable; safe to use from any thread. Sessions keep it
/// alive, so it may be released while they are open.
public final class Model {
    let handle: OpaquePointer

    public init(path: String, options: ModelOptions = ModelOptions()) throws {
        var params = ni_model_params()
        ni_model_params_init(&params)
        params.device = ni_device(options.device.rawValue)
        guard let index = Int32(exactly: options.deviceIndex) else {
            throw NanoInferError(code: .invalidArgument, operation: "ni_model_load",
                                 message: "deviceIndex must fit in 32 bits, got \(options.deviceIndex)")
        }
        params.device_index = index
        params.dtype = ni_dtype(options.dtype.rawValue)
        params.n_threads = try cUInt32(options.threads, "threads", "ni_model_load")
        params.quant = ni_quant(options.quant.rawValue)
        params.quant_group_size = try cUInt32(options.quantGroupSize, "quantGroupSize", "ni_model_load")
        params.quant_lm_head = options.quantLMHead
        var box: Unmanaged<ProgressBox>?
        if let progress = options.progress {
            let b = Unmanaged.passRetained(ProgressBox(progress))
            box = b
            params.progress = { value, userData in
                Unmanaged<ProgressBox>.fromOpaque(userData!).takeUnretainedValue().fn(value)
            }
            params.progress_user_data = b.toOpaque()
        }
        defer { box?.release() }
        var raw: OpaquePointer?
        try path.withCString { try check("ni_model_load", ni_model_load($0, &params, &raw)) }
        handle = raw!
    }

    deinit { ni_model_free(handle) }

    public func info() throws -> ModelInfo {
        var ci = ni_model_info()
        ci.struct_size = UInt32(MemoryLayout<ni_model_info>.size)
        try check("ni_model_get_info", ni_model_get_info(handle, &ci))
        return ModelInfo(
            architecture: String(cString: ci.architecture),
            vocabSize: Int(ci.vocab_size),
            contextLength: Int(ci.context_length),
            layers: Int(ci.n_layers),
            hiddenSize: Int(ci.hidden_size),
            heads: Int(ci.n_heads),
            kvHeads: Int(ci.n_kv_heads),
            headDim: Int(ci.head_dim),
            bosTokenID: Int(ci.bos_token_id),
            eosTokenIDs: tokens(ci.eos_token_ids, count: ci.n_eos_token_ids),
            hasTokenizer: ci.has_tokenizer,
            hasChatTemplate: ci.has_chat_template)
    }

    /// Token ids of `text`; `addSpecialTokens` adds e.g. BOS (not for chat-templated text).
    /// Special-token text in `text` becomes special tokens, so text a user typed
    /// can close its turn and forge others: use `tokenizeChat` for conversations
    /// and `tokenize(_:options:)` for raw user text.
    public func tokenize(_ text: String, addSpecialTokens: Bool = false) throws -> [UInt32] {
        var out: UnsafeMutablePointer<UInt32>?
        var count = 0
        let byteCount = text.utf8.count
        try text.withCString {
            try check("ni_tokenize", ni_tokenize(handle, $0, byteCount, addSpecialTokens, &out, &count))
        }
        defer { ni_tokens_free(out) }
        return tokens(UnsafePointer(out), count: count)
    }

    /// Token ids of `text`, read as `options` say (ni_tokenize_ex).
    public func tokenize(_ text: String, options: TokenizeOptions) throws -> [UInt32] {
        var flags: UInt32 = 0
        if options.addSpecialTokens { flags |= UInt32(NI_TOKENIZE_ADD_SPECIAL) }
        if options.parseSpecial { flags |= UInt32(NI_TOKENIZE_PARSE_SPECIAL) }
        var out: UnsafeMutablePointer<UInt32>?
        var count = 0
        let byteCount = text.utf8.count
        try text.withCString {
            try check("ni_tokenize_ex", ni_tokenize_ex(handle, $0, byteCount, flags, &out, &count))
        }
        defer { ni_tokens_free(out) }
        return tokens(UnsafePointer(out), count: count)
    }

    /// Token ids of `messages` rendered with the model's chat template, with
    /// special-token text inside the messages kept as ordinary text: only the
    /// template's own special tokens are special (ni_tokenize_chat). The way to
    /// turn untrusted chat text into a prompt, as is `Request.messages`.
    public func tokenizeChat(_ messages: [ChatMessage], addGenerationPrompt: Bool = true) throws -> [UInt32] {
        let arena = CArena()
        let cmsgs = messages.map {
            ni_chat_message(role: arena.cString($0.role), content: arena.cString($0.content))
        }
        var out: UnsafeMutablePointer<UInt32>?
        var count = 0
        try withExtendedLifetime(arena) {
            try cmsgs.withUnsafeBufferPointer {
                try check("ni_tokenize_chat",
                          ni_tokenize_chat(handle, $0.baseAddress, $0.count, addGenerationPrompt, &out, &count))
            }
        }
        defer { ni_tokens_free(out) }
        return tokens(UnsafePointer(out), count: count)
    }

    public func detokenize(_ ids: [UInt32], skipSpecialTokens: Bool = false) throws -> String {
        var out: UnsafeMutablePointer<CChar>?
        var length = 0
        try ids.withUnsafeBufferPointer {
            try check("ni_detokenize", ni_detokenize(handle, $0.baseAddress, $0.count, skipSpecialTokens, &out, &length))
        }
        defer { ni_string_free(out) }
        return string(UnsafePointer(out), count: length)
    }

    /// Renders `messages` with the model's chat template. Tokenizing the text
    /// reads special-token text inside the messages as special tokens; for
    /// untrusted messages use `tokenizeChat` or `Request.messages`.
    public func applyChatTemplate(_ messages: [ChatMessage], addGenerationPrompt: Bool = true) throws -> String {
        let arena = CArena()
        let cmsgs = messages.map {
            ni_chat_message(role: arena.cString($0.role), content: arena.cString($0.content))
        }
        var out: UnsafeMutablePointer<CChar>?
        var length = 0
        try withExtendedLifetime(arena) {
            try cmsgs.withUnsafeBufferPointer {
                try check("ni_apply_chat_template",
                          ni_apply_chat_template(handle, $0.baseAddress, $0.count, addGenerationPrompt, &out, &length))
            }
        }
        defer { ni_string_free(out) }
        return string(UnsafePointer(out), count: length)
    }
}
