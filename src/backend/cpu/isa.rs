//! Runtime CPU feature detection, done once.

use once_cell::sync::Lazy;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// aarch64 Advanced SIMD (every aarch64 CPU has it).
    Neon,
    Avx2Fma,
    Avx512,
}

static DETECTED: Lazy<Isa> = Lazy::new(detect);

fn detect() -> Isa {
    if crate::tuning::var("NANOINFER_ISA").as_deref() == Some("scalar") {
        return Isa::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let force_avx2 = crate::tuning::var("NANOINFER_ISA").as_deref() == Some("avx2");
        if !force_avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
        {
            return Isa::Avx512;
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2Fma;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return Isa::Neon;
    }
    Isa::Scalar
}

/// The instruction set the kernels use (override with
/// `NANOINFER_ISA=scalar|avx2|avx512` on x86-64, `scalar|neon` on aarch64).
pub fn isa() -> Isa {
    *DETECTED
}

static VNNI: Lazy<bool> = Lazy::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        isa() == Isa::Avx512
            && crate::tuning::var("NANOINFER_ISA").as_deref() != Some("avx512")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
});

/// AVX-512 VNNI (`vpdpbusd`) for the int8 kernels (off with `NANOINFER_ISA=avx512`).
pub fn has_vnni() -> bool {
    *VNNI
}

static DOTPROD: Lazy<bool> = Lazy::new(|| {
    #[cfg(target_arch = "aarch64")]
    {
        isa() == Isa::Neon
            && crate::tuning::var("NANOINFER_ISA").as_deref() != Some("neon")
            && std::arch::is_aarch64_feature_detected!("dotprod")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
});

/// aarch64 dot products (`sdot`, Armv8.2's DotProd) for the int8 kernels;
/// off with `NANOINFER_ISA=neon` (plain NEON: widening multiplies).
pub fn has_dotprod() -> bool {
    *DOTPROD
}

/// Whether the switch `var` is not `0` (unset: on), and `NANOINFER_ISA`
/// does not ask for plain AVX-512 (no extensions).
fn switch_on(var: &str) -> bool {
    crate::tuning::on_unless_zero(var)
        && crate::tuning::var("NANOINFER_ISA").as_deref() != Some("avx512")
}

static AVX512_BF16: Lazy<bool> = Lazy::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        isa() == Isa::Avx512
            && switch_on("NANOINFER_AVX512_BF16")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
});

/// AVX-512 BF16 (`vdpbf16ps`) for packed BF16 weights (Zen 4+, Cooper Lake,
/// Sapphire Rapids+); off with `NANOINFER_AVX512_BF16=0` or
/// `NANOINFER_ISA=scalar|avx2|avx512`.
pub fn has_avx512_bf16() -> bool {
    *AVX512_BF16
}

static AMX_BF16: Lazy<bool> =
    Lazy::new(|| isa() == Isa::Avx512 && switch_on("NANOINFER_AMX") && amx::enable_bf16());

/// AMX-BF16 tiles (`tdpbf16ps`, Sapphire Rapids+) for packed BF16 weights:
/// the CPU has them, the OS saves their state, and (Linux) this process was
/// granted their use. Off with `NANOINFER_AMX=0` or
/// `NANOINFER_ISA=scalar|avx2|avx512`.
pub fn has_amx_bf16() -> bool {
    *AMX_BF16
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use std::arch::asm;
    use std::arch::x86_64::{__cpuid, __cpuid_count};

    /// XCR0 bits of the tile configuration (17) and tile data (18) state.
    const XCR0_TILE: u64 = 0b11 << 17;
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;

    /// Checks CPUID and XCR0, then asks Linux for the tile data state (once
    /// per process, for all its threads). Any step failing leaves AMX off.
    pub(super) fn enable_bf16() -> bool {
        // SAFETY: CPUID exists on every x86_64 CPU; leaf 7 is read only when
        // leaf 0 says it exists. (`__cpuid` is a safe function from Rust
        // 1.9x on, an unsafe one before.)
        #[allow(unused_unsafe)]
        let (max_leaf, leaf1, leaf7) = unsafe {
            let max_leaf = __cpuid(0).eax;
            if max_leaf < 7 {
                return false;
            }
            (max_leaf, __cpuid(1), __cpuid_count(7, 0))
        };
        let amx_bf16 = leaf7.edx & (1 << 22) != 0;
        let amx_tile = leaf7.edx & (1 << 24) != 0;
        let osxsave = leaf1.ecx & (1 << 27) != 0;
        if max_leaf < 7 || !amx_bf16 || !amx_tile || !osxsave {
            return false;
        }
        let (lo, hi): (u32, u32);
        // SAFETY: OSXSAVE is set, so XGETBV is enabled; XCR0 is index 0. It
        // reads a register only.
        unsafe {
            asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi,
                 options(nostack, nomem, preserves_flags));
        }
        let xcr0 = (u64::from(hi) << 32) | u64::from(lo);
        if xcr0 & XCR0_TILE != XCR0_TILE {
            return false;
        }
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) takes two integers and
        // touches no memory of ours; a kernel without it returns an error.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        rc == 0
    }
}

/// Other systems: AMX stays off (only Linux's permission request is wired).
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod amx {
    pub(super) fn enable_bf16() -> bool {
        false
    }
}
