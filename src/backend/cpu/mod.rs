//! CPU backend: SIMD kernels with runtime feature detection and a persistent
//! thread pool.

pub mod attention;
pub mod elem;
pub mod isa;
pub mod matmul;
pub mod ops;
pub mod threadpool;
pub mod vector;

pub use matmul::{matmul, Matrix, MatrixData};
pub use threadpool::ThreadPool;
