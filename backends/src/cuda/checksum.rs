//! A GPU kernel that checksums bytes where they lie (managed or device
//! memory), as PTX embedded here and loaded with `cuModuleLoadData`: no nvcc
//! is needed to build. The checksum is position-weighted so reordered or
//! shifted bytes show: `sum(byte[i] * (i + 1)) mod 2^64`.

use std::ffi::{c_void, CString};

use cudarc::driver::result;
use cudarc::driver::sys;

use super::{driver, CudaError, Gpu};

const PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry weighted_sum(
    .param .u64 data,
    .param .u64 len,
    .param .u64 out
)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [data];
    ld.param.u64 %rd2, [len];
    ld.param.u64 %rd3, [out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd7, 0;
LOOP:
    setp.ge.u64 %p, %rd4, %rd2;
    @%p bra DONE;
    add.u64 %rd8, %rd1, %rd4;
    ld.global.u8 %r5, [%rd8];
    cvt.u64.u32 %rd9, %r5;
    add.u64 %rd10, %rd4, 1;
    mul.lo.u64 %rd9, %rd9, %rd10;
    add.u64 %rd7, %rd7, %rd9;
    add.u64 %rd4, %rd4, %rd6;
    bra LOOP;
DONE:
    red.global.add.u64 [%rd3], %rd7;
    ret;
}
"#;

/// The same checksum on the CPU.
pub fn cpu_checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_add(u64::from(b).wrapping_mul(i as u64 + 1))
    })
}

/// The loaded checksum kernel and its 8-byte result buffer.
#[derive(Debug)]
pub struct Checksum {
    gpu: Gpu,
    module: sys::CUmodule,
    func: sys::CUfunction,
    out: u64,
}

impl Checksum {
    /// JIT-compiles the embedded PTX for `gpu`.
    pub fn load(gpu: &Gpu) -> Result<Checksum, CudaError> {
        gpu.bind()?;
        let image = CString::new(PTX).expect("the PTX has no NUL byte");
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(driver("cuModuleLoadData"))?;
        let name = CString::new("weighted_sum").expect("no NUL");
        // SAFETY: `module` was just loaded and is not unloaded before `Drop`.
        let func = match unsafe { result::module::get_function(module, name) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: the module loaded above is unloaded once, here.
                let _ = unsafe { result::module::unload(module) };
                return Err(driver("cuModuleGetFunction")(e));
            }
        };
        // SAFETY: a plain 8-byte allocation on the current context.
        let out = unsafe { result::malloc_sync(8) }.map_err(driver("cuMemAlloc"))?;
        Ok(Checksum {
            gpu: gpu.clone(),
            module,
            func,
            out,
        })
    }

    /// Checksums `len` bytes at device-visible address `addr` (managed or
    /// device memory) on the GPU and waits for the answer.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of this GPU's context that the GPU
    /// may read (managed, device, or mapped pinned memory) and that nothing
    /// frees or writes until this call returns.
    pub unsafe fn run(&self, addr: u64, len: usize) -> Result<u64, CudaError> {
        self.gpu.bind()?;
        // SAFETY: `out` is our live 8-byte device allocation.
        unsafe { sys::cuMemsetD8_v2(self.out, 0, 8) }
            .result()
            .map_err(driver("cuMemsetD8"))?;
        let threads = 256u32;
        let blocks = (len / (threads as usize * 16)).clamp(1, 4096) as u32;
        let (mut data, mut n, mut out) = (addr, len as u64, self.out);
        let mut params = [
            (&mut data as *mut u64).cast::<c_void>(),
            (&mut n as *mut u64).cast::<c_void>(),
            (&mut out as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: `func` is a live kernel taking three u64 parameters, given
        // pointers to three u64 locals that outlive the synchronous wait below;
        // the caller guarantees the data range (this function's contract).
        unsafe {
            result::launch_kernel(
                self.func,
                (blocks, 1, 1),
                (threads, 1, 1),
                0,
                std::ptr::null_mut(),
                &mut params,
            )
        }
        .map_err(driver("cuLaunchKernel"))?;
        self.gpu.synchronize()?;
        let mut sum = [0u64; 1];
        // SAFETY: `out` holds 8 bytes; the kernel finished (synchronized above).
        unsafe { result::memcpy_dtoh_sync(&mut sum, self.out) }.map_err(driver("cuMemcpyDtoH"))?;
        Ok(sum[0])
    }
}

impl Drop for Checksum {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: both were created in `load` and are released once, here.
            unsafe {
                let _ = result::free_sync(self.out);
                let _ = result::module::unload(self.module);
            }
        }
    }
}
