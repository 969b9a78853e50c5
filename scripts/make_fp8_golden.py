#!/usr/bin/env python3
"""The FP8 golden: transformers reads the FP8 checkpoint `nanoinfer quantize
--method fp8` writes, and its greedy ids and top-5 logits are recorded.

Runs where torch + transformers are installed (the lent GPU machine; tests
and CI only read the JSON). Here:

    nanoinfer quantize --model tests/data/tiny-llama3 --out cpu-carry/fp8-tiny --method fp8
    cp scripts/make_fp8_golden.py cpu-carry/
then there (device tool, carry ["cpu-carry"]):
    python3 cpu-carry/make_fp8_golden.py cpu-carry/fp8-tiny $OUT/tiny-llama3-fp8.json
and commit the JSON as tests/data/goldens/tiny-llama3-fp8.json.

transformers loads the checkpoint through its FineGrainedFP8 integration
with `dequantize=True` (weights = E4M3 code x block scale, computed in
float32 on the CPU, eager attention): the values NanoInfer's CPU path
computes with, so the logits must agree to float32 rounding. Where a GPU
is present, the FP8 kernel path (activations quantized too) is run as
well and its greedy ids recorded for information only.
"""
import json, sys

import torch
import transformers
from safetensors import safe_open

PROMPTS = [[1, 17, 42, 99, 7, 200], [5, 250, 3, 3, 128, 64, 77, 12, 9]]
STEPS, TOP_K = 16, 5


def greedy(model, prompt, device):
    ids, out, tops = list(prompt), [], []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
        vals, idx = torch.topk(logits, TOP_K)
        tops.append([[int(i), float(v)] for i, v in zip(idx, vals)])
        out.append(int(idx[0]))
        ids.append(int(idx[0]))
    return out, tops


def main(ckpt, out_path):
    cfg = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, quantization_config=cfg, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    w = model.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.float32, f"dequantized weight is {w.dtype}"
    cases = []
    for i, p in enumerate(PROMPTS):
        ids, tops = greedy(model, p, "cpu")
        cases.append({"name": f"ids{i}", "prompt_ids": p, "output_ids": ids, "top_logits": tops})
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        probe = {
            "tensor": "model.layers.0.mlp.down_proj.weight",
            "first_codes": f.get_tensor("model.layers.0.mlp.down_proj.weight").view(torch.uint8).flatten()[:16].tolist(),
            "scale_inv": f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv").flatten().tolist(),
        }
    golden = {
        "schema_version": 1,
        "generator": "scripts/make_fp8_golden.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": "tests/data/tiny-llama3, `nanoinfer quantize --method fp8`",
        "loaded_by": "transformers FineGrainedFP8Config(dequantize=True), float32, eager, CPU",
        "checkpoint_probe": probe,
        "top_k": TOP_K,
        "cases": cases,
    }
    if torch.cuda.is_available():
        try:
            gpu = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, torch_dtype=torch.bfloat16, device_map="cuda"
            ).eval()
            golden["gpu_fp8_kernels_output_ids"] = [greedy(gpu, p, "cuda")[0] for p in PROMPTS]
        except Exception as e:  # information only
            golden["gpu_fp8_kernels_error"] = f"{type(e).__name__}: {e}"[:300]
    json.dump(golden, open(out_path, "w"), indent=1)
    print(json.dumps({k: golden[k] for k in ("transformers_version", "loaded_by")}))
    print("cpu ids:", [c["output_ids"] for c in cases])
    print("gpu:", golden.get("gpu_fp8_kernels_output_ids", golden.get("gpu_fp8_kernels_error")))


if __name__ == "__main__":
    main(*sys.argv[1:3])
