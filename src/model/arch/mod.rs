//! The architecture families. The decoder layout they share is written once
//! (`model::transformer` over the backends' ops, `model::weight_upload` for
//! the tensor names); a family only says which of the layout's options its
//! checkpoints use. A new family is one small file here and a line in
//! [`FAMILIES`], as long as its layers fit the shared program (a family
//! that needs a new op, such as a different norm or activation, adds it to
//! the program and the backends first).

mod llama;
mod qwen2;
mod qwen3;

/// The layout options of the shared decoder a family's checkpoints use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
}

/// config.json settings a family's layout depends on.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayoutSettings {
    /// `attention_bias`.
    pub attention_bias: bool,
}

/// One architecture family.
#[derive(Debug)]
pub struct Family {
    /// The `architectures` name config.json gives it.
    pub hf_name: &'static str,
    pub layout: fn(LayoutSettings) -> Layout,
}

/// Every supported family.
pub const FAMILIES: &[&Family] = &[&llama::LLAMA, &qwen2::QWEN2, &qwen3::QWEN3];

/// The family config.json's `architectures` name, if supported.
pub fn family(hf_name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.hf_name == hf_name)
}

/// The supported names, for errors.
pub fn supported() -> String {
    FAMILIES
        .iter()
        .map(|f| f.hf_name)
        .collect::<Vec<_>>()
        .join(", ")
}
