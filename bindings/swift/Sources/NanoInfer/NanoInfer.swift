// A thin Swift wrapper over nanoinfer.h, mirroring the Go binding.

import CNanoInfer
import Foundation

/// Library facts.
public enum NanoInfer {
    /// The library version, e.g. "0.1.0".
    public static var version: String { String(cString: ni_version()) }
    /// The ABI version of the loaded library (compare with `headerABIVersion`).
    public static var abiVersion: UInt32 { ni_abi_version() }
    /// The ABI version this package was compiled against.
    public static let headerABIVersion = UInt32(NI_ABI_VERSION)
}

/// A failed library call: its status and the library's message.
public struct NanoInferError: Error, CustomStringConvertible {
    public enum Code: Int32 {
        case invalidArgument = 1, io, invalidModel, unsupported, outOfMemory, cancelled, busy, internalError, panic
        case unknown = -1
    }
    public let code: Code
    /// The C function that failed, e.g. "ni_model_load".
    public let operation: String
    /// `ni_last_error()` of the call.
    public let message: String
    public var description: String { "nanoinfer: \(operation): \(message)" }
}

/// `value` as the C field's unsigned 32-bit type, or an `invalidArgument`
/// error naming the field: Swift's plain conversion would trap (and end the
/// app) on a negative or oversized Int.
func cUInt32(_ value: Int, _ field: String, _ operation: String) throws -> UInt32 {
    guard let v = UInt32(exactly: value) else {
        throw NanoInferError(code: .invalidArgument, operation: operation,
                             message: "\(field) must be in [0, \(UInt32.max)], got \(value)")
    }
    return v
}

/// As `cUInt32`, for the C fields of 64 bits.
func cUInt64(_ value: Int, _ field: String, _ operation: String) throws -> UInt64 {
    guard let v = UInt64(exactly: value) else {
        throw NanoInferError(code: .invalidArgument, operation: operation,
                             message: "\(field) must be >= 0, got \(value)")
    }
    return v
}

/// Throws the calling thread's last error when `status` is not NI_OK. Call it
/// right after the C call, on the same thread (the message is thread-local).
@inline(__always)
func check(_ operation: String, _ status: ni_status) throws {
    if status == ni_status(NI_OK) { return }
    throw NanoInferError(
        code: NanoInferError.Code(rawValue: status) ?? .unknown,
        operation: operation,
        message: String(cString: ni_last_error()))
}

/// Memory handed to C for the duration of one call, freed together.
final class CArena {
    private var blocks: [UnsafeMutableRawPointer] = []

    func copy<T>(_ values: [T]) -> UnsafePointer<T>? {
        if values.isEmpty { return nil }
        let raw = malloc(MemoryLayout<T>.stride * values.count)!
        blocks.append(raw)
        let typed = raw.bindMemory(to: T.self, capacity: values.count)
        typed.initialize(from: values, count: values.count)
        return UnsafePointer(typed)
    }

    /// A NUL-terminated copy of `s`.
    func cString(_ s: String) -> UnsafePointer<CChar> {
        let p = strdup(s)!
        blocks.append(UnsafeMutableRawPointer(p))
        return UnsafePointer(p)
    }

    deinit { blocks.forEach { free($0) } }
}

func string(_ p: UnsafePointer<CChar>?, count: Int) -> String {
    guard let p = p, count > 0 else { return "" }
    return p.withMemoryRebound(to: UInt8.self, capacity: count) {
        String(decoding: UnsafeBufferPointer(start: $0, count: count), as: UTF8.self)
    }
}

func tokens(_ p: UnsafePointer<UInt32>?, count: Int) -> [UInt32] {
    guard let p = p, count > 0 else { return [] }
    return Array(UnsafeBufferPointer(start: p, count: count))
}

// MARK: - Logging

public enum LogLevel: UInt32 {
    case error = 1, warn, info, debug
}

private final class LoggerBox {
    let fn: (LogLevel, String) -> Void
    init(_ fn: @escaping (LogLevel, String) -> Void) { self.fn = fn }
}

private let loggerLock = NSLock()
private var loggerBox: Unmanaged<LoggerBox>?

/// Routes the library's log messages to `fn` (nil drops them). `fn` may be
/// called from several threads at once. Once this returns, the previous
/// logger is no longer called.
public func setLogger(_ fn: ((LogLevel, String) -> Void)?) throws {
    loggerLock.lock()
    defer { loggerLock.unlock() }
    let box = fn.map { Unmanaged.passRetained(LoggerBox($0)) }
    let status: ni_status
    if let box = box {
        status = ni_set_log_callback({ level, message, userData in
            let b = Unmanaged<LoggerBox>.fromOpaque(userData!).takeUnretainedValue()
            b.fn(LogLevel(rawValue: level) ?? .debug, message.map { String(cString: $0) } ?? "")
        }, box.toOpaque())
    } else {
        status = ni_set_log_callback(nil, nil)
    }
    do {
        try check("ni_set_log_callback", status)
    } catch {
        box?.release()
        throw error
    }
    loggerBox?.release()
    loggerBox = box
}
