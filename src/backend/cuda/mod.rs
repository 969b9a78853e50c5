//! The CUDA device layer: driver, NVRTC and cuBLAS loaded at run time
//! (cudarc with dynamic loading), so the crate builds and runs its CPU path
//! on machines without CUDA; opening a device there fails with a clear error.
//!
//! Everything runs on one stream per device handle. Buffers are owned by
//! `DeviceBuffer`s; kernels take raw device addresses, which stay valid for
//! as long as the owning buffer lives.

pub mod decoder;
mod gemm;
mod kernels;
mod pending;
mod pool;
mod profile;
pub mod sampling;
mod staging;
mod w4;
mod w4_gemm;
mod w4_ops;
mod w8;

pub use gemm::GemmDType;
pub use kernels::{Kernel, KernelCache, Kernels};
pub use pending::PendingIds;
pub use pool::{create_device_pool, CudaBuddy, CudaStreamPool, BUDDY_MIN_BLOCK, DEVICE_ALIGN};
pub use staging::Staging;
pub use w4::W4Host;
pub use w4_gemm::{w4_packed_blocks, w4_packed_rows, W4GemmBlocks, W4_PACKED_THREADS};
pub use w4_ops::{QkvEpilogue, W4Handoff, W4Matrix, W4Norm, W4Out, HANDOFF_ROWS};
pub use w8::W8Matrix;

use crate::memory::{DeviceAllocation, DevicePool};
use crate::{Error, ErrorKind, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use profile::Profiler;
use std::sync::{Arc, Mutex};

// Kernel arguments are passed as 8-byte slots whose first bytes hold the
// value (see `CudaDevice::launch_raw`).
#[cfg(target_endian = "big")]
compile_error!("the CUDA backend assumes a little-endian host");

/// 16-bit activation/weight type on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActDType {
    BF16,
    F16,
}

impl ActDType {
    pub fn name(self) -> &'static str {
        match self {
            ActDType::BF16 => "bf16",
            ActDType::F16 => "f16",
        }
    }

    /// Converts f32 values to this dtype's raw bits.
    pub fn encode(self, values: &[f32]) -> Vec<u16> {
        match self {
            ActDType::BF16 => values
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect(),
            ActDType::F16 => values
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect(),
        }
    }

    pub fn decode(self, bits: u16) -> f32 {
        match self {
            ActDType::BF16 => half::bf16::from_bits(bits).to_f32(),
            ActDType::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }
}

/// Maps a CUDA/cuBLAS/NVRTC failure to an error naming the operation.
pub fn cuda_error(what: &str, err: impl std::fmt::Debug) -> Error {
    let text = format!("{err:?}");
    let kind = if text.contains("OUT_OF_MEMORY") || text.contains("ALLOC_FAILED") {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Internal
    };
    Error::new(kind, format!("CUDA error in {what}: {text}"))
}

/// Checks that the shared libraries the backend needs can be loaded, so a
/// machine without them gets an error instead of a panic inside cudarc.
fn check_libraries() -> Result<()> {
    for (lib, what) in [
        ("cuda", "the NVIDIA driver (libcuda.so)"),
        (
            "nvrtc",
            "NVRTC (libnvrtc.so, CUDA toolkit or the nvidia-cuda-nvrtc wheel)",
        ),
        ("cublas", "cuBLAS (libcublas.so)"),
    ] {
        let found = cudarc::get_lib_name_candidates(lib).iter().any(|name| {
            // SAFETY: loading a CUDA library runs its initializers, which is
            // what using the backend does anyway; the handle is dropped.
            unsafe { libloading::Library::new(name) }.is_ok()
        });
        if !found {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "CUDA is not available: {what} was not found (set LD_LIBRARY_PATH to its directory)"
                ),
            ));
        }
    }
    Ok(())
}

const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Must match GEMV_MAX_ROWS / GEMV_WARPS in kernels/decoder.cu.
const GEMV_MAX_ROWS: usize = 8;
const GEMV_WARPS: usize = 4;

/// One GPU: its context, the compute stream, a cuBLAS handle on that stream
/// and the compiled kernels.
pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    pub kernels: Kernels,
    pub act: ActDType,
    pub name: String,
    /// Compute capability (major, minor).
    pub arch: (i32, i32),
    pub sm_count: usize,
    /// Small-batch projections through our GEMV kernels (NANOINFER_CUDA_GEMV=0: cuBLAS only).
    use_gemv: bool,
    /// Most rows a GEMV kernel takes (`NANOINFER_CUDA_GEMV_ROWS`, default
    /// 1): on an H200 (CUDA 13) an 8B bf16 step of 2 to 8 rows takes
    /// 4.5-4.6 ms through cuBLAS against 8-29 ms through the multi-row
    /// GEMV kernels, whose time grows with the rows (BENCHMARKS.md
    /// "Speculative decoding").
    gemv_rows: usize,
    /// Large int4 batches through the tensor-core GEMM (sm_90).
    w4_gemm: w4_gemm::W4Gemm,
    /// The GEMM's counters of tiles split by stream-K and flags of their
    /// partial sums (zero between launches).
    split_counters: DeviceBuffer<u32>,
    /// Which kernels are launched programmatically (sm_90+), i.e. may start
    /// while the previous one drains.
    pdl: EarlyLaunch,
    profiler: Option<Mutex<Profiler>>,
    /// Held for the whole of one forward: sessions sharing the model take
    /// turns on the stream and the cuBLAS handle.
    pub step_lock: Mutex<()>,
}

impl CudaDevice {
    pub fn open(ordinal: usize, act: ActDType) -> Result<Arc<CudaDevice>> {
        check_libraries()?;
        let count = CudaContext::device_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("CUDA device {ordinal} does not exist ({count} devices found)"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error("cuCtxCreate", e))?;
        // One stream, ordered by construction: cudarc's per-buffer event
        // tracking would only add overhead.
        // SAFETY: every buffer of this context is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured
        // into CUDA graphs.
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_error("cublasCreate", e))?;
        // A workspace of our own, so cuBLAS never allocates while a decode
        // step is being captured into a graph.
        let blas_workspace = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
            .map_err(|e| cuda_error("allocating the cuBLAS workspace", e))?;
        {
            let (ptr, _sync) = blas_workspace.device_ptr(&stream);
            // SAFETY: the workspace outlives the handle (both live in the
            // returned CudaDevice, the workspace declared after `blas` so it
            // is dropped later) and is used by this handle only.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut _,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()
            .map_err(|e| cuda_error("cublasSetWorkspace", e))?;
        }
        let arch = ctx
            .compute_capability()
            .map_err(|e| cuda_error("compute capability", e))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| cuda_error("SM count", e))? as usize;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let kernels = Kernels::load(&ctx, arch, act, &KernelCache::from_env())?;
        if arch.0 >= 8 {
            // Int4 weights need sm_80+ (their MMAs); older GPUs refuse them.
            w4_ops::allow_norm_staging(&kernels)?;
        }
        let w4_gemm = w4_gemm::W4Gemm::for_device(arch);
        let split_counters = if w4_gemm != w4_gemm::W4Gemm::Off {
            w4_gemm::allow_gemm_smem(&kernels)?;
            w4_gemm::SPLIT_COUNTERS + w4_gemm::ready_flags(sm_count)
        } else {
            1
        };
        let split_counters = DeviceBuffer::new(
            stream
                .alloc_zeros::<u32>(split_counters)
                .map_err(|e| cuda_error("allocating the int4 GEMM's counters", e))?,
            &stream,
        );
        let profiler = Profiler::from_env(&ctx);
        let pdl = if arch.0 < 9 || profiler.is_some() {
            EarlyLaunch::None
        } else {
            EarlyLaunch::from_env()
        };
        Ok(Arc::new(CudaDevice {
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            kernels,
            act,
            name,
            arch,
            sm_count,
            use_gemv: switch_on("NANOINFER_CUDA_GEMV"),
            gemv_rows: crate::tuning::var("NANOINFER_CUDA_GEMV_ROWS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
                .clamp(1, GEMV_MAX_ROWS),
            w4_gemm,
            split_counters,
            pdl,
            profiler: profiler.map(Mutex::new),
            step_lock: Mutex::new(()),
        }))
    }

    /// Whether `NANOINFER_CUDA_PROFILE` is timing every launch (the decoder
    /// then runs without CUDA graphs).
    pub fn profiling(&self) -> bool {
        self.profiler.is_some()
    }

    /// Runs `op` (which enqueues work), timed under `label` when profiling.
    fn timed(
        &self,
        label: impl FnOnce() -> String,
        bytes: usize,
        op: impl Fn() -> Result<()>,
    ) -> Result<()> {
        match &self.profiler {
            None => op(),
            Some(p) => {
                p.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .time(&self.stream, label, bytes, op)
            }
        }
    }

    /// Launches `f` on the compute stream with 1-D blocks of `block` threads.
    pub fn launch(
        &self,
        f: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        args: &[KArg],
    ) -> Result<()> {
        self.timed(
            || f.name.to_string(),
            0,
            || self.launch_raw(f, grid, block, 0, args),
        )
    }

    /// Launches `f` with `shared` bytes of dynamic shared memory.
    fn launch_raw(
        &self,
        f: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[KArg],
    ) -> Result<()> {
        const MAX_ARGS: usize = 24;
        if args.len() > MAX_ARGS {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("kernel {} takes more than {MAX_ARGS} arguments", f.name),
            ));
        }
        let mut values = [0u64; MAX_ARGS];
        for (slot, a) in values.iter_mut().zip(args) {
            *slot = match *a {
                KArg::Ptr(p) => p,
                KArg::I32(v) => v as u32 as u64,
                KArg::F32(v) => v.to_bits() as u64,
            };
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for (p, v) in params.iter_mut().zip(values.iter_mut()) {
            *p = (v as *mut u64).cast();
        }
        // SAFETY: an all-zero launch attribute value is a valid (empty) union.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut pdl = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut pdl,
            numAttrs: self.pdl.applies_to(f) as u32,
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: the arguments match the kernel's parameter list (each call
        // site mirrors the signature in kernels/decoder.cu; 4-byte parameters
        // read the low half of their little-endian slot), every pointer is a
        // live allocation sized for the grid by the caller, and `values`,
        // `params` and `pdl` outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| cuda_error(&format!("launching kernel {}", f.name), e))
    }

    /// (free, total) device memory in bytes, after the stream-ordered pool
    /// has given back what freed buffers left cached in it.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.release_cached()?;
        self.ctx
            .mem_get_info()
            .map_err(|e| cuda_error("cuMemGetInfo", e))
    }

    /// A zero-filled buffer of `len` elements (driver allocation: weights
    /// and other buffers that live as long as the model).
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let slice = self
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| cuda_error(&format!("allocating {len} elements"), e))?;
        Ok(DeviceBuffer::new(slice, &self.stream))
    }

    /// A zero-filled buffer of `len` elements from `pool` (a session's
    /// workspace and KV cache), given back to it when dropped.
    pub fn alloc_in<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        pool: &Arc<dyn DevicePool>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .max(1)
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    format!("a buffer of {len} elements overflows the address space"),
                )
            })?;
        let allocation = pool.allocate(bytes, DEVICE_ALIGN)?;
        let ptr = allocation.addr();
        // Owned from here: an error below gives the allocation back.
        let buf = DeviceBuffer {
            storage: Storage::Pool {
                allocation: Some(allocation),
                pool: pool.clone(),
            },
            ptr,
            len: len.max(1),
        };
        // SAFETY: `ptr .. ptr + bytes` is the live allocation just made.
        unsafe { self.zero(ptr, bytes) }?;
        Ok(buf)
    }

    /// Zeroes `bytes` bytes at `ptr`, ordered on the stream.
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` must be device memory of this context that
    /// stays allocated until the stream has run the memset.
    pub(crate) unsafe fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: the caller's contract.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_error("zeroing device memory", e))
    }

    /// Copies `host` to the start of `dst`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T], dst: &mut DeviceBuffer<T>) -> Result<()> {
        self.upload_at(host, dst, 0)
    }

    /// Copies `host` into `dst` starting at element `offset`.
    pub fn upload_at<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut DeviceBuffer<T>,
        offset: usize,
    ) -> Result<()> {
        if !self.prepare_copy("upload", host.len(), dst.len(), offset)? {
            return Ok(());
        }
        // SAFETY: `dst.at(offset) ..` + `host`'s bytes lies inside `dst`
        // (checked above). From pageable memory the driver returns once
        // `host` has been staged, so it may be reused at once.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.at(offset), host, self.stream.cu_stream())
        }
        .map_err(|e| cuda_error("host-to-device copy", e))
    }

    /// Checks that `len` elements at `offset` lie inside a buffer of
    /// `capacity`. Binds the context for the copy and returns true, or
    /// returns false when there is nothing to copy.
    fn prepare_copy(&self, what: &str, len: usize, capacity: usize, offset: usize) -> Result<bool> {
        if offset.saturating_add(len) > capacity {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("{what} of {len} elements at {offset} overflows a buffer of {capacity}"),
            ));
        }
        if len == 0 {
            return Ok(false);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        Ok(true)
    }

    /// Copies the first `host.len()` elements of `src` to `host`; waits for
    /// the stream (the one host synchronization of a step).
    pub fn download<T: DeviceRepr>(&self, src: &DeviceBuffer<T>, host: &mut [T]) -> Result<()> {
        self.download_at(src, 0, host)
    }

    /// Copies `host.len()` elements of `src` from element `offset` on.
    pub fn download_at<T: DeviceRepr>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        host: &mut [T],
    ) -> Result<()> {
        if !self.prepare_copy("download", host.len(), src.len(), offset)? {
            return Ok(());
        }
        // SAFETY: `host` has room for its length, which `src` covers
        // (checked above); the stream is synchronized before `host` is
        // read or released.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(host, src.at(offset), self.stream.cu_stream())
        }
        .map_err(|e| cuda_error("device-to-host copy", e))?;
        self.synchronize()
    }

    /// Bytes of device memory used (total − free), without trimming the
    /// default pool first (a measurement must not change what it measures).
    pub fn used_memory(&self) -> Result<usize> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| cuda_error("cuMemGetInfo", e))?;
        Ok(total - free)
    }

    /// The device's default stream-ordered pool (where driver-path buffers
    /// come from).
    fn default_pool(&self) -> Result<sys::CUmemoryPool> {
        let mut pool = std::ptr::null_mut();
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: valid out-pointer; the device handle lives as long as `self.ctx`.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(|e| cuda_error("cuDeviceGetDefaultMemPool", e))?;
        Ok(pool)
    }

    /// The default pool's reserved bytes (current, high-water mark).
    pub fn default_pool_reserved(&self) -> Result<(u64, u64)> {
        use sys::CUmemPool_attribute as A;
        let pool = self.default_pool()?;
        let get = |attr| {
            let mut v = 0u64;
            // SAFETY: the pool is live; these attributes are cuuint64_t.
            unsafe {
                cudarc::driver::result::mem_pool::get_attribute(
                    pool,
                    attr,
                    (&mut v as *mut u64).cast(),
                )
            }
            .map(|_| v)
            .map_err(|e| cuda_error("cuMemPoolGetAttribute", e))
        };
        Ok((
            get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        ))
    }

    /// Resets the default pool's high-water marks to its current use.
    pub fn reset_default_pool_peaks(&self) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        let pool = self.default_pool()?;
        for attr in [
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        ] {
            let mut zero = 0u64;
            // SAFETY: the pool is live; setting a high-water mark to 0
            // resets it to the current value (the only value allowed).
            unsafe {
                cudarc::driver::result::mem_pool::set_attribute(
                    pool,
                    attr,
                    (&mut zero as *mut u64).cast(),
                )
            }
            .map_err(|e| cuda_error("cuMemPoolSetAttribute(high)", e))?;
        }
        Ok(())
    }

    /// Returns memory cached by the device's default (stream-ordered) pool
    /// to the driver: buffers are allocated with cuMemAllocAsync, and a
    /// dropped session's KV cache would otherwise still count as used.
    pub fn release_cached(&self) -> Result<()> {
        self.synchronize()?;
        let pool = self.default_pool()?;
        // SAFETY: the default pool lives as long as the device.
        unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }
            .map_err(|e| cuda_error("cuMemPoolTrimTo", e))
    }

    /// Records what `enqueue` puts on the stream into a replayable graph.
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        use cudarc::driver::sys;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda_error("cuStreamBeginCapture", e))?;
        let enqueued = enqueue();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| cuda_error("cuStreamEndCapture", e));
        enqueued?;
        graph?
            .map(Graph)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "CUDA graph capture recorded nothing"))
    }

    pub fn replay(&self, graph: &Graph) -> Result<()> {
        graph.0.launch().map_err(|e| cuda_error("cuGraphLaunch", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("stream synchronize", e))?;
        match &self.profiler {
            Some(p) => p.lock().unwrap_or_else(|e| e.into_inner()).collect(),
            None => Ok(()),
        }
    }

    /// Whether a projection of `rows` activation rows over `k` inputs runs
    /// through the GEMV kernels (decode-sized batches) rather than cuBLAS.
    pub fn gemv_fits(&self, rows: usize, k: usize) -> bool {
        rows <= self.gemv_rows && k.is_multiple_of(8) && self.use_gemv
    }

    /// Launches a GEMV-family kernel over `warps` warp work units (one or
    /// two weight rows each) of a `rows`×`k` by `n`×`k` product; batch-1
    /// steps take the family's one-row kernel, FP8 weights its `*_f8` build
    /// (`args` hold the weight's address; the scale arguments follow).
    pub fn launch_gemv(
        &self,
        family: GemvFamily,
        weight: GemvWeight<'_>,
        warps: usize,
        (rows, n, k): (usize, usize, usize),
        args: &[KArg],
    ) -> Result<()> {
        let kn = &self.kernels;
        let fp8 = matches!(weight, GemvWeight::Fp8(_));
        let f = match (family, rows == 1, fp8) {
            (GemvFamily::Plain, true, false) => &kn.gemv_r1,
            (GemvFamily::Plain, false, false) => &kn.gemv,
            (GemvFamily::SwiGlu, true, false) => &kn.gemv_swiglu_r1,
            (GemvFamily::SwiGlu, false, false) => &kn.gemv_swiglu,
            (GemvFamily::QkvRope, true, false) => &kn.gemv_qkv_rope_r1,
            (GemvFamily::QkvRope, false, false) => &kn.gemv_qkv_rope,
            (GemvFamily::Plain, true, true) => &kn.gemv_f8_r1,
            (GemvFamily::Plain, false, true) => &kn.gemv_f8,
            (GemvFamily::SwiGlu, true, true) => &kn.gemv_swiglu_f8_r1,
            (GemvFamily::SwiGlu, false, true) => &kn.gemv_swiglu_f8,
            (GemvFamily::QkvRope, true, true) => &kn.gemv_qkv_rope_f8_r1,
            (GemvFamily::QkvRope, false, true) => &kn.gemv_qkv_rope_f8,
        };
        let bytes = n * k * if fp8 { 1 } else { 2 };
        // The caller's arguments, then the FP8 scale arguments: on the
        // stack, not a Vec per launch.
        let mut all = [KArg::I32(0); GEMV_MAX_ARGS];
        let mut len = args.len();
        all[..len].copy_from_slice(args);
        if let GemvWeight::Fp8(m) = weight {
            let extra = m.gemv_args();
            all[len..len + extra.len()].copy_from_slice(&extra);
            len += extra.len();
        }
        let all = &all[..len];
        self.timed(
            || format!("{} {rows}x{n}x{k}", f.name),
            bytes,
            || {
                self.launch_raw(
                    f,
                    (warps.div_ceil(GEMV_WARPS) as u32, 1, 1),
                    32 * GEMV_WARPS as u32,
                    0,
                    all,
                )
            },
        )
    }

    /// `y[rows, n] (op)= x[rows, k] · w[n, k]ᵀ` through the GEMV kernel
    /// (`gemv_fits` must hold). With `norm = (weight, eps)`, x holds residual
    /// rows and the product takes `rmsnorm(x) * weight` instead.
    pub fn gemv(
        &self,
        x: u64,
        w: GemvWeight<'_>,
        y: u64,
        (rows, n, k): (usize, usize, usize),
        out: GemvOut,
        norm: Option<(u64, f32)>,
    ) -> Result<()> {
        let (nw, eps) = norm.unwrap_or((0, 0.0));
        self.launch_gemv(
            GemvFamily::Plain,
            w,
            n,
            (rows, n, k),
            &[
                KArg::Ptr(x),
                KArg::Ptr(w.ptr()),
                KArg::Ptr(y),
                KArg::I32(n as i32),
                KArg::I32(k as i32),
                KArg::I32(rows as i32),
                KArg::I32(out as i32),
                KArg::Ptr(nw),
                KArg::F32(eps),
            ],
        )
    }

    /// `y[rows, n] = x[rows, k] · w[n, k]ᵀ` (w row-major, the HF layout),
    /// 16-bit inputs, f32 accumulation; `y` is 16-bit or f32 per `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
        out: GemmDType,
    ) -> Result<()> {
        if self.gemv_fits(rows, k) {
            // Decode-sized batches are bandwidth-bound: our GEMV streams the
            // weights closer to the copy bandwidth than cuBLAS does.
            let out = match out {
                GemmDType::Act => GemvOut::Act,
                GemmDType::F32 => GemvOut::F32,
            };
            return self.gemv(x, GemvWeight::Act(w), y, (rows, n, k), out, None);
        }
        self.timed(
            || format!("cublas {rows}x{n}x{k}"),
            n * k * 2,
            || gemm::gemm_xwt(&self.blas, self.act, x, w, y, rows, n, k, out),
        )
    }
}

/// The GEMV kernels of kernels/decoder.cu, each in a one-row and a
/// multi-row build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvFamily {
    Plain,
    /// Gate and up rows fused with SwiGLU.
    SwiGlu,
    /// QKV fused with bias, RoPE and the KV-cache write.
    QkvRope,
}

/// Most arguments a GEMV-family kernel takes (`gemv_qkv_rope_f8`: 19).
const GEMV_MAX_ARGS: usize = 20;

/// The weight operand of a GEMV kernel.
#[derive(Clone, Copy)]
pub enum GemvWeight<'a> {
    /// Rows in the activation dtype at this address.
    Act(u64),
    /// FP8 rows and their scales.
    Fp8(&'a W8Matrix),
}

impl GemvWeight<'_> {
    /// The address of the weight rows.
    pub fn ptr(self) -> u64 {
        match self {
            GemvWeight::Act(p) => p,
            GemvWeight::Fp8(m) => m.codes_ptr(),
        }
    }
}

/// What the plain GEMV does with its result (GEMV_OUT_* of kernels/decoder.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvOut {
    /// Written in the activation dtype.
    Act = 0,
    /// Written as f32 (logits).
    F32 = 1,
    /// Added to y in place (a residual add), rounded as transformers does.
    ResidualAdd = 2,
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Some(p) = &self.profiler {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            if p.collect().is_ok() {
                eprint!("{}", p.report());
            }
        }
    }
}

/// An instantiated CUDA graph of one decode step.
pub struct Graph(cudarc::driver::CudaGraph);

// SAFETY: a graph exec may be launched from any thread; cudarc binds the
// owning context before launching, and a session (the only owner) is driven
// by one thread at a time.
unsafe impl Send for Graph {}

/// One kernel argument: a device address (0 for an absent optional
/// pointer), an int or a float.
#[derive(Debug, Clone, Copy)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// Where a [`DeviceBuffer`]'s memory comes from.
enum Storage<T: DeviceRepr> {
    /// A driver allocation (cudarc), dropped by hand (see `Drop`).
    Driver(std::mem::ManuallyDrop<CudaSlice<T>>),
    /// An allocation of a session's device pool, given back on drop.
    Pool {
        /// Taken once, in `Drop`.
        allocation: Option<DeviceAllocation>,
        pool: Arc<dyn DevicePool>,
    },
}

/// A device allocation with its raw address cached for kernel arguments:
/// from the driver ([`CudaDevice::alloc`]) or from a session's pool
/// ([`CudaDevice::alloc_in`]).
pub struct DeviceBuffer<T: DeviceRepr> {
    storage: Storage<T>,
    ptr: u64,
    len: usize,
}

/// Buffers from this size up are freed synchronously.
const SYNC_FREE_BYTES: usize = 64 << 20;

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let bytes = self.bytes();
        match &mut self.storage {
            Storage::Driver(slice) => {
                // cudarc frees on the stream (cuMemFreeAsync): a large buffer
                // (a session's KV cache) only returns to the device's pool
                // once its stream gets there, and until then another model's
                // budget, which trims the pool, would still count it as used.
                let wait_for = (bytes >= SYNC_FREE_BYTES).then(|| slice.stream().clone());
                // SAFETY: `slice` is taken once, here, and never used again.
                drop(unsafe { std::mem::ManuallyDrop::take(slice) });
                if let Some(stream) = wait_for {
                    let _ = stream.synchronize();
                }
            }
            Storage::Pool { allocation, pool } => {
                // Stream-ordered: queued kernels still using the memory
                // run before any later reuse. The pool itself gives its
                // memory to the driver (after a synchronize) when the last
                // buffer holding it is gone.
                if let Some(a) = allocation.take() {
                    let _ = pool.release(a);
                }
            }
        }
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    fn new(slice: CudaSlice<T>, stream: &CudaStream) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        DeviceBuffer {
            len: slice.len(),
            storage: Storage::Driver(std::mem::ManuallyDrop::new(slice)),
            ptr,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of element `offset`.
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.len());
        self.ptr + (offset * std::mem::size_of::<T>()) as u64
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }

    /// Whether the buffer came from a session's device pool.
    pub fn is_pooled(&self) -> bool {
        matches!(self.storage, Storage::Pool { .. })
    }
}

/// Whether the comparison switch `var` (e.g. `NANOINFER_CUDA_GRAPHS`) is
/// on: unset or anything but `0`.
pub(crate) fn switch_on(var: &str) -> bool {
    crate::tuning::on_unless_zero(var)
}

/// The number in `var` (e.g. `NANOINFER_CUDA_W4_GEMM_ROWS`), or `default`
/// when it is unset or not a number.
pub(crate) fn env_number<T: std::str::FromStr>(var: &str, default: T) -> T {
    crate::tuning::number(var, default)
}

/// Programmatic dependent launch policy (`NANOINFER_CUDA_PDL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EarlyLaunch {
    /// `0`: every kernel waits for the previous one to finish.
    None,
    /// Default: only kernels that request their inputs before waiting for
    /// the previous kernel (`Kernel::prefetches_before_wait`): the int4
    /// products, decode attention and the one-row plain GEMV. On an H100
    /// (8B shape, batch 1) int4 decode gave 352-355 tok/s with the int4
    /// products launched early, against 336 with no early launch; the plain
    /// GEMV launched early took bf16 decode from 174.0 to 175.5. Launching
    /// every kernel early, the fused QKV and gate/up GEMVs among them,
    /// slowed bf16 decode (167.4 tok/s against 171.0).
    Prefetching,
    /// `1`: every kernel.
    All,
}

impl EarlyLaunch {
    fn from_env() -> EarlyLaunch {
        match crate::tuning::var("NANOINFER_CUDA_PDL").as_deref() {
            Some("0") => EarlyLaunch::None,
            Some("1") => EarlyLaunch::All,
            _ => EarlyLaunch::Prefetching,
        }
    }

    fn applies_to(self, f: &Kernel) -> bool {
        match self {
            EarlyLaunch::None => false,
            EarlyLaunch::Prefetching => f.prefetches_before_wait(),
            EarlyLaunch::All => true,
        }
    }
}
