#!/usr/bin/env python3
"""A tiny random Llama with a real tokenizer and chat template, for runs where
the 540 MB default model is too slow (valgrind, ASan, soak):

  make_tiny_chat_model.py --tokenizer models/SmolLM2-135M-Instruct --out DIR

Writes DIR/config.json (hidden 64, 2 layers, 4 heads, 2 KV heads, tied
embeddings, the tokenizer's vocabulary size), DIR/model.safetensors (F32,
seeded normal values, ~13 MB for SmolLM2's 49,152 tokens) and copies
tokenizer.json / tokenizer_config.json / generation_config.json from the
tokenizer directory. Its output is gibberish; it exercises every code path
of a chat run at a fraction of the cost. Needs numpy. Reruns are no-ops.
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="model dir with tokenizer.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    src_cfg = json.load(open(os.path.join(args.tokenizer, "config.json")))
    vocab = int(src_cfg["vocab_size"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": src_cfg.get("bos_token_id"),
        "eos_token_id": src_cfg.get("eos_token_id"),
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "head_dim": HEAD_DIM,
        "intermediate_size": FFN,
        "max_position_embeddings": 2048,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "vocab_size": vocab,
    }
    stamp = os.path.join(args.out, "config.json")
    if os.path.exists(stamp) and json.load(open(stamp)) == config \
            and os.path.exists(os.path.join(args.out, "model.safetensors")):
        return
    os.makedirs(args.out, exist_ok=True)

    rng = np.random.default_rng(args.seed)
    tensors = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        })
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        shape = tensors[name]
        if len(shape) == 1:
            a = (1.0 + 0.1 * rng.standard_normal(shape)).astype("<f4")
        else:
            a = (0.3 * rng.standard_normal(shape)).astype("<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(args.tokenizer, name)):
            shutil.copy(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    # config.json last: it is the stamp that makes a rerun a no-op.
    with open(stamp, "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    main()
