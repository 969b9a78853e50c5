// swift-tools-version:5.9
import PackageDescription

let package = Package(
    name: "NanoInfer",
    products: [
        .library(name: "NanoInfer", targets: ["NanoInfer"]),
    ],
    targets: [
        // The installed C library, found through pkg-config (nanoinfer.pc).
        .systemLibrary(name: "CNanoInfer", path: "Sources/CNanoInfer", pkgConfig: "nanoinfer"),
        .target(name: "NanoInfer", dependencies: ["CNanoInfer"]),
        .testTarget(name: "NanoInferTests", dependencies: ["NanoInfer"]),
    ]
)
