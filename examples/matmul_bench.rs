//! Decode-step matmul benchmark: the dense matmuls of one decode step of a
//! SmolLM2-135M-shaped model (30 layers of q/k/v, o, gate/up, down and the
//! LM head) with random packed BF16 weights, at several row counts.
//!
//! ```text
//! cargo run --release --example matmul_bench -- [--threads 2] [--rows 1,16] [--reps 20] [--layers 30] [--head on|off] [--only NxK]
//! ```
//! Prints per row count: ms per step (median and min), GFLOP/s and the weight
//! bytes streamed per second.

use nanoinfer::backend::cpu::elem::Bf16;
use nanoinfer::backend::cpu::{matmul, Matrix, MatrixData, PackedBf16, ThreadPool};
use std::time::Instant;

struct Layer {
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

fn random_matrix(seed: &mut u64, rows: usize, cols: usize) -> Matrix {
    let w: Vec<Bf16> = (0..rows * cols)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
            Bf16((v.to_bits() >> 16) as u16)
        })
        .collect();
    let p = PackedBf16::pack(rows, cols, &w).expect("packing");
    Matrix {
        rows,
        cols,
        data: MatrixData::BF16Packed(p),
    }
}

fn main() {
    let mut threads = 2;
    let mut rows_list = vec![1usize, 16];
    let mut reps = 20;
    let mut n_layers = 30;
    let mut with_head = true;
    let mut only: Option<(usize, usize)> = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let v = pair.get(1).map(String::as_str).unwrap_or("");
        match pair[0].as_str() {
            "--threads" => threads = v.parse().expect("--threads N"),
            "--rows" => {
                rows_list = v
                    .split(',')
                    .map(|s| s.parse().expect("--rows a,b"))
                    .collect()
            }
            "--reps" => reps = v.parse().expect("--reps N"),
            "--layers" => n_layers = v.parse().expect("--layers N"),
            "--head" => with_head = v == "on",
            "--only" => {
                let (n, k) = v.split_once('x').expect("--only NxK");
                only = Some((n.parse().expect("N"), k.parse().expect("K")));
            }
            f => panic!("unknown flag {f}"),
        }
    }
    let (d, inter, kvd, vocab) = (576, 1536, 192, 49152);
    let mut seed = 7u64;
    if let Some((n, k)) = only {
        let pool = ThreadPool::new(threads);
        let w = random_matrix(&mut seed, n, k);
        for &m in &rows_list {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
                .collect();
            let mut out = vec![0f32; m * n];
            let mut times = Vec::with_capacity(reps);
            for rep in 0..reps + 2 {
                let t = Instant::now();
                matmul(&pool, &x, m, &[&w], &mut out);
                if rep >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let flop = 2.0 * (n * k * m) as f64;
            println!(
                "[{n}x{k}] rows {m}: median {:.1} us ({:.1} GFLOP/s), min {:.1} us ({:.1} GFLOP/s)",
                times[times.len() / 2] * 1e6,
                flop / times[times.len() / 2] / 1e9,
                times[0] * 1e6,
                flop / times[0] / 1e9
            );
        }
        return;
    }
    let layers: Vec<Layer> = (0..n_layers)
        .map(|_| Layer {
            q: random_matrix(&mut seed, d, d),
            k: random_matrix(&mut seed, kvd, d),
            v: random_matrix(&mut seed, kvd, d),
            o: random_matrix(&mut seed, d, d),
            gate: random_matrix(&mut seed, inter, d),
            up: random_matrix(&mut seed, inter, d),
            down: random_matrix(&mut seed, d, inter),
        })
        .collect();
    let head = random_matrix(&mut seed, vocab, d);
    let params =
        n_layers * (2 * d * d + 2 * kvd * d + 3 * inter * d) + usize::from(with_head) * vocab * d;
    let pool = ThreadPool::new(threads);
    println!("{n_layers} layers + head, {threads} threads, {reps} reps");
    println!("| rows | ms/step median | min | GFLOP/s (median) | weights GB/s |");
    println!("|---:|---:|---:|---:|---:|");
    for &m in &rows_list {
        let x: Vec<f32> = (0..m * inter)
            .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
            .collect();
        let mut qkv = vec![0f32; m * (d + 2 * kvd)];
        let mut proj = vec![0f32; m * d];
        let mut gu = vec![0f32; m * 2 * inter];
        let mut logits = vec![0f32; m * vocab];
        let mut times = Vec::with_capacity(reps);
        for rep in 0..reps + 2 {
            let t = Instant::now();
            for l in &layers {
                matmul(&pool, &x, m, &[&l.q, &l.k, &l.v], &mut qkv);
                matmul(&pool, &x, m, &[&l.o], &mut proj);
                matmul(&pool, &x, m, &[&l.gate, &l.up], &mut gu);
                matmul(&pool, &x, m, &[&l.down], &mut proj);
            }
            if with_head {
                matmul(&pool, &x, m, &[&head], &mut logits);
            }
            if rep >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[times.len() / 2];
        println!(
            "| {m} | {:.2} | {:.2} | {:.1} | {:.1} |",
            med * 1e3,
            times[0] * 1e3,
            2.0 * params as f64 * m as f64 / med / 1e9,
            2.0 * params as f64 / med / 1e9,
        );
    }
}
