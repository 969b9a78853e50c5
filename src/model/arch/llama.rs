//! Llama (and what publishes as `LlamaForCausalLM`: SmolLM2, Llama 2 and 3,
//! many fine-tunes): the shared layout as it is; `attention_bias` puts
//! biases on q, k, v and o.

use super::{Family, Layout};

pub const LLAMA: Family = Family {
    hf_name: "LlamaForCausalLM",
    layout: |s| Layout {
        qkv_bias: s.attention_bias,
        o_bias: s.attention_bias,
        qk_norm: false,
    },
};
