//! Qwen3: a per-head RMSNorm of q and k before RoPE; `attention_bias` puts
//! biases on q, k, v and o.

use super::{Family, Layout};

pub const QWEN3: Family = Family {
    hf_name: "Qwen3ForCausalLM",
    layout: |s| Layout {
        qkv_bias: s.attention_bias,
        o_bias: s.attention_bias,
        qk_norm: true,
    },
};
