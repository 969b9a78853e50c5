//! Runtime CPU feature detection, done once.

use once_cell::sync::Lazy;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2Fma,
    Avx512,
}

static DETECTED: Lazy<Isa> = Lazy::new(detect);

fn detect() -> Isa {
    if std::env::var("NANOINFER_ISA").ok().as_deref() == Some("scalar") {
        return Isa::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let force_avx2 = std::env::var("NANOINFER_ISA").ok().as_deref() == Some("avx2");
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
    Isa::Scalar
}

/// The instruction set the kernels use (override with `NANOINFER_ISA=scalar|avx2|avx512`).
pub fn isa() -> Isa {
    *DETECTED
}

static VNNI: Lazy<bool> = Lazy::new(|| {
    #[cfg(target_arch = "x86_64")]
    {
        isa() == Isa::Avx512
            && std::env::var("NANOINFER_ISA").ok().as_deref() != Some("avx512")
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
