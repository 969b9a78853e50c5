//! Qwen2 and Qwen2.5: biases on q, k and v always, none on o.

use super::{Family, Layout};

pub const QWEN2: Family = Family {
    hf_name: "Qwen2ForCausalLM",
    layout: |_| Layout {
        qkv_bias: true,
        o_bias: false,
        qk_norm: false,
    },
};
