#!/usr/bin/env python3
"""SmolLM2-135M-shaped models with random weights, for benchmarking on a
machine that cannot receive the real weights (e.g. a lent machine with a
64 MiB upload limit). Speed does not depend on the values.

  random_smollm2.py skeleton --gguf SmolLM2-135M-Instruct-F32.gguf --out skeleton.pkl
      (here: keeps the GGUF's metadata, tokenizer included, and tensor shapes; ~1 MB)
  random_smollm2.py make --skeleton skeleton.pkl --config config.json --out DIR
      (there: DIR/F32.gguf for llama.cpp, DIR/f32 and DIR/bf16 safetensors for NanoInfer,
       same random values; needs numpy, torch, safetensors and llama.cpp's gguf-py on
       PYTHONPATH)
"""
import argparse, json, os, pickle

import gguf
import numpy as np


def skeleton(args):
    r = gguf.GGUFReader(args.gguf)
    kv = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else None
            vals = [f.parts[i].tolist() for i in f.data]
            vals = [bytes(v).decode("utf-8", "surrogateescape") for v in vals] if sub == gguf.GGUFValueType.STRING else [v[0] for v in vals]
            kv.append((name, vt, sub, vals))
        else:
            v = f.parts[f.data[0]].tolist()
            kv.append((name, vt, None, bytes(v).decode("utf-8") if vt == gguf.GGUFValueType.STRING else v[0]))
    tensors = [(t.name, [int(x) for x in t.shape]) for t in r.tensors]
    pickle.dump({"kv": kv, "tensors": tensors}, open(args.out, "wb"))


HF_PART = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def make(args):
    import torch
    from safetensors.torch import save_file
    sk = pickle.load(open(args.skeleton, "rb"))
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in sk["tensors"]:
        np_shape = tuple(shape[::-1])
        arrays[name] = np.ones(np_shape, np.float32) if len(np_shape) == 1 else rng.standard_normal(np_shape, dtype=np.float32) * 0.02
    w = gguf.GGUFWriter(os.path.join(args.out, "F32.gguf"), "llama")
    for name, vt, sub, val in sk["kv"]:
        if name == "general.architecture":
            continue
        if name == "general.file_type":
            val = 0  # all F32
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, val, vt, sub_type=sub)
        else:
            w.add_key_value(name, val, vt)
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    st = {}
    for name, a in arrays.items():
        if name in hf:
            st[hf[name]] = a
        else:
            _, n, part, _ = name.split(".")
            st[f"model.layers.{n}.{HF_PART[part]}.weight"] = a
    config = json.load(open(args.config))
    for sub, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        d = os.path.join(args.out, sub)
        os.makedirs(d, exist_ok=True)
        save_file({k: torch.from_numpy(v).to(dt).contiguous() for k, v in st.items()}, os.path.join(d, "model.safetensors"))
        json.dump(config, open(os.path.join(d, "config.json"), "w"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="cmd", required=True)
    a = s.add_parser("skeleton"); a.add_argument("--gguf", required=True); a.add_argument("--out", required=True)
    b = s.add_parser("make"); b.add_argument("--skeleton", required=True); b.add_argument("--config", required=True); b.add_argument("--out", required=True)
    args = p.parse_args()
    skeleton(args) if args.cmd == "skeleton" else make(args)
