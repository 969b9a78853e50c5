//! Int4 (W4A16) product benchmark on the GPU: the projections of one
//! Llama-3-8B layer (QKV, o, gate/up + SwiGLU, down) with random packed
//! int4 weights (group 128), against the same shapes in bf16 through
//! `CudaDevice::gemm` (our GEMV up to its row limit, cuBLAS above it or
//! with `NANOINFER_CUDA_GEMV=0`). Above the fused int4 kernels' 128 rows
//! the int4 product is the tensor-core GEMM (sm_90; its plain output, no
//! SwiGLU), and a third time is printed: dequantization + cuBLAS, the path
//! of GPUs without the GEMM.
//!
//! ```text
//! cargo run --release --example w4_bench -- [--rows 1,8,16,32] [--reps 200]
//!     [--shapes gate_up:28672x4096,o:4096x4096]
//! ```
//! `--shapes` replaces the layer's shapes by `NAME:ROWSxCOLS` (weight rows ×
//! inputs); a name starting with `gate` takes the SwiGLU epilogue.
//! Prints per shape and row count: µs per product and the weight bytes
//! streamed per second, int4 and bf16, and their ratio. Successive calls
//! cycle through copies of the weights (over 200 MB of each kind), so the
//! products read them from memory, not from the 50 MB L2, as in a model.

use nanoinfer::backend::cuda::{ActDType, CudaDevice, GemmDType, W4Host, W4Matrix, W4Norm, W4Out};
use std::time::Instant;

const GROUP: usize = 128;
/// The most rows the fused int4 kernels take (the decoder's default).
const FUSED_MAX_ROWS: usize = 128;
/// Bytes of weight copies per shape and kind: four times the H100's L2.
const COLD_BYTES: usize = 200 << 20;

struct Shape {
    name: String,
    rows: usize,
    cols: usize,
    swiglu: bool,
}

/// One Llama-3-8B layer's products, as `NAME:ROWSxCOLS`.
const LAYER_SHAPES: &str = "qkv:6144x4096,o:4096x4096,gate_up:28672x4096,down:4096x14336";

fn parse_shapes(spec: &str) -> Vec<Shape> {
    spec.split(',')
        .map(|item| {
            let (name, dims) = item.split_once(':').expect("--shapes takes NAME:ROWSxCOLS");
            let (rows, cols) = dims.split_once('x').expect("--shapes takes NAME:ROWSxCOLS");
            let shape = Shape {
                name: name.to_string(),
                rows: rows.parse().expect("--shapes: weight rows"),
                cols: cols.parse().expect("--shapes: inputs"),
                swiglu: name.starts_with("gate"),
            };
            // Whole 16-row tiles (a gate/up pair per 32 rows), 64-input chunks.
            let tile = if shape.swiglu { 32 } else { 16 };
            assert!(
                shape.rows.is_multiple_of(tile)
                    && shape.cols.is_multiple_of(64)
                    && shape.rows > 0
                    && shape.cols > 0,
                "--shapes {item}: rows must be a multiple of {tile} and inputs of 64"
            );
            shape
        })
        .collect()
}

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 32) as u32
}

/// Random int4 weights in the kernels' layout: any bits are valid nibbles;
/// scales 2⁻⁷ (f16 0x2000) and zero 8 keep the products small.
fn random_w4(seed: &mut u64, rows: usize, cols: usize) -> W4Host {
    let tiles = rows / 16;
    let words = (0..tiles * (cols / 64) * 32 * 4)
        .map(|_| lcg(seed))
        .collect();
    let sz = vec![0x2000 | (8 << 16); tiles * cols.div_ceil(GROUP) * 16];
    W4Host {
        rows,
        cols,
        group: GROUP,
        words,
        sz,
        perm: None,
    }
}

/// Small random bf16 values (|v| < 2⁻⁴).
fn random_bf16(seed: &mut u64, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| {
            let v = (lcg(seed) as f32 / u32::MAX as f32 - 0.5) * 0.125;
            half::bf16::from_f32(v).to_bits()
        })
        .collect()
}

fn time_us(dev: &CudaDevice, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    dev.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    dev.synchronize().unwrap();
    t.elapsed().as_secs_f64() * 1e6 / reps as f64
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> nanoinfer::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let row_counts: Vec<usize> = arg(&args, "--rows")
        .unwrap_or_else(|| "1,8,16,32".into())
        .split(',')
        .map(|s| s.parse().expect("--rows takes numbers"))
        .collect();
    let reps: usize = arg(&args, "--reps").map_or(200, |s| s.parse().expect("--reps"));
    let shapes = parse_shapes(&arg(&args, "--shapes").unwrap_or_else(|| LAYER_SHAPES.into()));
    let max_rows = *row_counts.iter().max().unwrap_or(&1);
    let dev = CudaDevice::open(0, ActDType::BF16)?;
    let mut seed = 7u64;
    println!("shape    rows   int4 µs  int4 GB/s   bf16 µs  bf16 GB/s  bf16/int4");
    for s in &shapes {
        let host4 = random_w4(&mut seed, s.rows, s.cols);
        let w4_copies = (COLD_BYTES / host4.bytes()).max(1) + 1;
        let w4: Vec<W4Matrix> = (0..w4_copies)
            .map(|_| W4Matrix::upload(&dev, std::slice::from_ref(&host4), None))
            .collect::<nanoinfer::Result<_>>()?;
        let host16 = random_bf16(&mut seed, s.rows * s.cols);
        let dense_copies = (COLD_BYTES / (host16.len() * 2)).max(1) + 1;
        let dense: Vec<_> = (0..dense_copies)
            .map(|_| {
                let mut d = dev.alloc::<u16>(host16.len())?;
                dev.upload(&host16, &mut d)?;
                Ok(d)
            })
            .collect::<nanoinfer::Result<_>>()?;
        let mut x = dev.alloc::<u16>(max_rows * s.cols)?;
        dev.upload(&random_bf16(&mut seed, max_rows * s.cols), &mut x)?;
        let y = dev.alloc::<u16>(max_rows * s.rows)?;
        let xp = dev.alloc::<u16>(dev.w4_gemm_scratch_elems(max_rows, s.cols))?;
        for &rows in &row_counts {
            let out = if s.swiglu {
                W4Out::SwiGlu { out: y.ptr() }
            } else {
                W4Out::Act { y: y.ptr() }
            };
            let mut i = 0;
            let gemm = rows > FUSED_MAX_ROWS && dev.w4_gemm_available();
            let t4 = time_us(&dev, reps, || {
                i += 1;
                let w = &w4[i % w4.len()];
                if gemm {
                    dev.w4_gemm(x.ptr(), rows, w, y.ptr(), xp.ptr()).unwrap()
                } else {
                    dev.w4_mm(x.ptr(), rows, w, out, W4Norm::None).unwrap()
                }
            });
            let tb = time_us(&dev, reps, || {
                i += 1;
                let w = dense[i % dense.len()].ptr();
                dev.gemm(x.ptr(), w, y.ptr(), rows, s.rows, s.cols, GemmDType::Act)
                    .unwrap()
            });
            let flops = 2.0 * (rows * s.rows * s.cols) as f64;
            println!(
                "{:8} {rows:4} {t4:9.1} {:10.0} {tb:9.1} {:10.0} {:9.2}×  ({:.0} / {:.0} TFLOP/s)",
                s.name,
                w4[0].bytes() as f64 / t4 / 1e3,
                dense[0].bytes() as f64 / tb / 1e3,
                tb / t4,
                flops / t4 / 1e6,
                flops / tb / 1e6
            );
            if rows > FUSED_MAX_ROWS {
                let scratch = &dense[0];
                let td = time_us(&dev, reps, || {
                    i += 1;
                    dev.w4_dequant(&w4[i % w4.len()], scratch.ptr()).unwrap();
                    dev.gemm(
                        x.ptr(),
                        scratch.ptr(),
                        y.ptr(),
                        rows,
                        s.rows,
                        s.cols,
                        GemmDType::Act,
                    )
                    .unwrap()
                });
                println!(
                    "{:8} {rows:4} dequantize + cuBLAS {td:9.1} µs: the GEMM is {:.2}× faster",
                    s.name,
                    td / t4
                );
            }
        }
    }
    Ok(())
}
