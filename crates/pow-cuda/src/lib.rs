//! The proof-of-work's CUDA backend (issue 31, item 3): generation, the product and the row
//! hashes stay on the device; the leaf hashes (32 bytes a row) and the opened rows come
//! back, and C stays on the device between the commitment and the opening. Built for CUDA 12.8 with `cudarc`'s dynamic loading: libcuda, NVRTC and
//! cuBLAS are looked up when [`Cuda::open`] runs, so the workspace builds and tests without
//! CUDA, and a host without a GPU gets an error, not a crash.
//!
//! - **Generation**: `philox_fill` (kernels.cu), one thread per 16-byte Philox block, the
//!   counter layout of `cgx_pow::challenge::fill_rows`.
//! - **Product**: cuBLAS `cublasGemmEx`, int8 inputs, int32 output, `CUBLAS_COMPUTE_32I`,
//!   in the "TN" layout cuBLAS's tensor-core (IMMA) kernels take: B is generated transposed,
//!   and the column-major product Bᵀ·Aᵀ is the row-major A·B.
//! - **Time**: CUDA events around generation, product and hashing — the device's time, not
//!   the host's (allocation, the tree and the copies are outside it).
//! - **Hashing**: `row_leaves`, one thread per row, SHA-256 of 0x00 ‖ the row's bytes; the
//!   tree over the leaves is built on the host (n hashes).
//!
//! The kernels' C++ is checked on the CPU against the Rust code by `tests/kernels.rs`
//! wherever a C++ compiler is present; the GPU path itself against the CPU backend by
//! `tests/gpu.rs` wherever a GPU is (both say when they skip).

// Launching a kernel and calling cuBLAS are `unsafe` in cudarc: the arguments must match the
// kernel's parameters and the buffers their sizes. Each call below says why it does.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use cgx_pow::backend::Held;
use cgx_pow::challenge::{Challenge, Matrix};
use cgx_pow::proof::{Committed, Proof};
use cgx_pow::{Backend, PowError};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

/// The kernels' source.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Why the CUDA backend is not available, or failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) on this host")]
    NoDriver,
    #[error("no NVRTC or cuBLAS library on this host")]
    NoLibraries,
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("NVRTC: {0}")]
    Compile(String),
    #[error("cuBLAS: {0}")]
    Blas(String),
}

fn d(e: impl std::fmt::Display) -> CudaError {
    CudaError::Driver(e.to_string())
}

struct Inner {
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    fill: CudaFunction,
    leaves: CudaFunction,
}

/// One GPU's backend.
pub struct Cuda {
    name: String,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda({})", self.name)
    }
}

/// Whether libcuda can be loaded here (cudarc panics on a missing library, so ask first).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; nothing is called in it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Cuda {
    /// GPU `ordinal`: its context, the kernels compiled for it, a cuBLAS handle.
    pub fn open(ordinal: usize) -> Result<Cuda, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        // SAFETY: as above, library lookups only.
        let libs = unsafe {
            cudarc::nvrtc::sys::is_culib_present() && cudarc::cublas::sys::is_culib_present()
        };
        if !libs {
            return Err(CudaError::NoLibraries);
        }
        let ctx = CudaContext::new(ordinal).map_err(d)?;
        let name = ctx.name().map_err(d)?;
        let ptx =
            cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx).map_err(d)?;
        let stream = ctx.default_stream();
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Blas(e.to_string()))?;
        Ok(Cuda {
            name,
            inner: Mutex::new(Inner {
                fill: module.load_function("philox_fill").map_err(d)?,
                leaves: module.load_function("row_leaves").map_err(d)?,
                stream,
                blas,
            }),
        })
    }
}

fn grid(items: u64) -> LaunchConfig {
    let threads = 256u32;
    LaunchConfig {
        grid_dim: (
            u32::try_from(items.div_ceil(u64::from(threads))).unwrap_or(u32::MAX),
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Inner {
    /// The seed's matrix `m` into `out`, or its transpose.
    fn generate(
        &self,
        seed: &[u8; 32],
        m: Matrix,
        n: u32,
        transposed: bool,
        out: &mut CudaSlice<i8>,
    ) -> Result<(), CudaError> {
        let blocks = u64::from(n) * u64::from(n) / 16;
        let s = cgx_pow::challenge::seed_words(seed);
        let (k0, k1, c2, c3) = (s[0], s[1], s[2] ^ m as u32, s[3]);
        let t = i32::from(transposed);
        let mut b = self.stream.launch_builder(&self.fill);
        b.arg(out)
            .arg(&blocks)
            .arg(&n)
            .arg(&t)
            .arg(&k0)
            .arg(&k1)
            .arg(&c2)
            .arg(&c3);
        // SAFETY: philox_fill(signed char*, unsigned long long, unsigned int, int, unsigned
        // int × 4): `out` holds n² bytes, 16 for each of the `blocks` threads that write.
        unsafe { b.launch(grid(blocks)) }.map_err(d)?;
        Ok(())
    }

    fn commit(&self, ch: &Challenge) -> Result<(OnDevice, f64), CudaError> {
        let n = ch.params.n;
        let nu = n as usize;
        let mut a = self.stream.alloc_zeros::<i8>(nu * nu).map_err(d)?;
        let mut bt = self.stream.alloc_zeros::<i8>(nu * nu).map_err(d)?;
        let mut c = self.stream.alloc_zeros::<i32>(nu * nu).map_err(d)?;
        let mut leaves = self.stream.alloc_zeros::<u8>(32 * nu).map_err(d)?;
        // The device's time: from the first kernel to the last hash, by CUDA events.
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timed).map_err(d)?;
        self.generate(&ch.seed, Matrix::A, n, false, &mut a)?;
        // B transposed: the product runs as cuBLAS's "TN" int8 GEMM, the layout its tensor-
        // core (IMMA) kernels take.
        self.generate(&ch.seed, Matrix::B, n, true, &mut bt)?;
        {
            let ni = i32::try_from(n).map_err(|_| CudaError::Blas("n".into()))?;
            let (alpha, beta) = (1i32, 0i32);
            let (pa, _ra) = a.device_ptr(&self.stream);
            let (pb, _rb) = bt.device_ptr(&self.stream);
            let (pc, _rc) = c.device_ptr_mut(&self.stream);
            // SAFETY: A and Bᵀ hold n² int8, C n² int32 on this stream's device; alpha and
            // beta are int32 host values, as CUBLAS_COMPUTE_32I takes them. Row-major Bᵀ read
            // column-major is B, so op T gives Bᵀ; row-major A read column-major is Aᵀ: the
            // column-major product Bᵀ·Aᵀ is row-major A·B.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    ni,
                    ni,
                    ni,
                    (&alpha as *const i32).cast(),
                    pb as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_8I,
                    ni,
                    pa as *const std::ffi::c_void,
                    cudaDataType::CUDA_R_8I,
                    ni,
                    (&beta as *const i32).cast(),
                    pc as *mut std::ffi::c_void,
                    cudaDataType::CUDA_R_32I,
                    ni,
                    cublasComputeType_t::CUBLAS_COMPUTE_32I,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| CudaError::Blas(e.to_string()))?;
        }
        let mut l = self.stream.launch_builder(&self.leaves);
        l.arg(&c).arg(&n).arg(&mut leaves);
        // SAFETY: row_leaves(const int*, unsigned int, unsigned char*): C holds n rows of n
        // int32, `leaves` 32 bytes for each of the n threads.
        unsafe { l.launch(grid(u64::from(n))) }.map_err(d)?;
        let end = self.stream.record_event(timed).map_err(d)?;
        let hashes = self.stream.clone_dtoh(&leaves).map_err(d)?;
        end.synchronize().map_err(d)?;
        let gpu_ms = f64::from(start.elapsed_ms(&end).map_err(d)?);
        let leaves: Vec<[u8; 32]> = hashes
            .chunks_exact(32)
            .map(|h| {
                let mut x = [0u8; 32];
                x.copy_from_slice(h);
                x
            })
            .collect();
        let committed = Committed::new(ch, leaves).map_err(|e| CudaError::Driver(e.to_string()))?;
        Ok((
            OnDevice {
                stream: self.stream.clone(),
                c,
                committed,
            },
            gpu_ms,
        ))
    }
}

/// C on the device and the commitment to its rows, until the opening.
struct OnDevice {
    stream: Arc<CudaStream>,
    c: CudaSlice<i32>,
    committed: Committed,
}

impl Held for OnDevice {
    fn root(&self) -> cgx_protocol::merkle::Hash {
        self.committed.root()
    }

    fn open(&self, opening: &[u8; 32]) -> Result<Proof, PowError> {
        let n = self.committed.n as usize;
        self.committed.open(opening, |i| {
            let at = i as usize * n;
            self.stream
                .clone_dtoh(&self.c.slice(at..at + n))
                .map_err(|e| PowError::Shape(format!("on the GPU: {e}")))
        })
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        format!("cuda: {}", self.name)
    }

    fn commit(&self, ch: &Challenge) -> Result<(Box<dyn Held>, f64), PowError> {
        ch.params.check()?;
        let inner = self
            .inner
            .lock()
            .map_err(|_| PowError::Shape("the CUDA backend failed earlier".into()))?;
        let (held, gpu_ms) = inner
            .commit(ch)
            .map_err(|e| PowError::Shape(format!("on the GPU: {e}")))?;
        Ok((Box::new(held), gpu_ms))
    }
}
