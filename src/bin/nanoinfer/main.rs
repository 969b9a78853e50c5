//! `nanoinfer`: generate text, measure perplexity and benchmark from the
//! command line. The option names are a contract (README.md).

mod args;
mod bench;
mod generate;
mod perplexity;
mod quantize;
mod serve;
mod serve_bench;
mod session_opts;

use args::Args;

const USAGE: &str = "usage:
  nanoinfer generate --model DIR (--prompt TEXT ... | --prompts-file PATH | --prompt-ids 1,2,3)
                     [--chat] [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P]
                     [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]
                     [--seed S] [--stop STR ...] [--logprobs N] [--ignore-eos]
                     [--device cpu|cuda[:N]] [--threads N] [--dtype auto|f32|f16|bf16]
                     [--quant none|q8_0|awq|gptq] [--json]
                     [--kv-backend paged|token] [--block-size N] [--kv-capacity TOKENS]
                     [--gpu-memory-utilization F] [--memory-utilization F]
                     [--memory-pool arena|slab|system|cuda-stream|cuda-buddy] [--kv-cache-dtype auto|fp8]
                     [--max-batched-tokens N] [--max-seqs N] [--prefill-chunk N]
                     [--policy fcfs|priority] [--preemption recompute|swap] [--no-prefix-cache]
                     [--host-sampling] [--json-schema FILE | --regex R | --grammar FILE | --choice A --choice B ...]
                     [--save-state FILE] [--load-state FILE (prompt optional: appended as raw text)]
                     [--save-prefix-cache DIR] [--load-prefix-cache DIR]
  nanoinfer perplexity --model DIR --file PATH [--max-tokens 1024] [--device ..] [--threads N] [--dtype ..]
                     [--quant ..] [--json]
  nanoinfer bench --model DIR [-p 512] [-n 128] [-r|--repetitions 3] [--device ..] [-t|--threads N]
                  [--dtype auto|f32|f16|bf16] [--quant none|q8_0|awq|gptq] [--seed S]
                  [--memory-pool arena|slab|system|cuda-stream|cuda-buddy] [--kv-cache-dtype auto|fp8]
                  [-d DEPTH] [--json]
  nanoinfer bench --model DIR --num-requests N [--input-len 512] [--output-len 256] [--concurrency 0]
                  [--device ..] [session options] [--seed S] [--json]
                  (serving: output tok/s, TTFT/TPOT percentiles, host time per step)
  nanoinfer quantize --model DIR --out DIR --method q8_0|awq|gptq [--group-size 32|64|128]
                     [--lm-head q8_0|int4|dense] [--sym true|false] [--json]
                     [--calib FILE [--calib-tokens 2048] [--act-order] [--damp 0.01] [--awq-clip]]
  nanoinfer serve --model DIR [--host 127.0.0.1] [--port 8080] [--api-key KEY] [session options]
                  (OpenAI-compatible HTTP server and chat page; `nanoinfer serve --help`)
  --json-schema/--regex/--grammar (llguidance's Lark dialect)/--choice: structured output; every
  token keeps the text a prefix of a match, and it ends only on a full match.
  --device cuda runs on GPU 0 (bf16 unless --dtype f16); the CPU is the default.
  --quant q8_0 quantizes at load; --quant-group-size 32|64|128 (default 32) and
  --quant-lm-head q8_0|dense (default q8_0) refine it. --quant awq|gptq: int4
  round-to-nearest at load (group 128 unless --quant-group-size; LM head dense
  unless --quant-lm-head int4, which GPTQ checkpoints store as lm_head: true;
  --quant-sym false: asymmetric GPTQ). AWQ/GPTQ checkpoints (quantization_config
  in config.json) load as int4 by themselves; --quant q8_0 with one quantizes
  the dense LM head.
  --memory-pool picks where the CPU forward takes its step temporaries (default
  arena: one region planned from the model and --max-batched-tokens/--max-seqs),
  or where a GPU session's workspace and KV cache live (default cuda-stream: a
  stream-ordered pool of its own; cuda-buddy: one allocation sized for the session).
  --memory-utilization F sizes the KV cache as F of total memory minus weights
  minus the planned workspace (vLLM rule; never more than is available now).
  --max-batched-tokens / --max-seqs default to 512 / 64 on the CPU and 8192 / 256
  on a GPU; --prefill-chunk defaults to the step's token budget.
  --kv-cache-dtype fp8 (CUDA) stores keys and values as FP8 e4m3, unscaled: twice the
  tokens per byte of KV memory and half the bytes decode attention reads.";

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let rest = &argv[1..];
    let result = match cmd.as_str() {
        "generate" => Args::parse(rest, generate::FLAGS).and_then(|a| generate::run(&a)),
        "perplexity" => Args::parse(rest, perplexity::FLAGS).and_then(|a| perplexity::run(&a)),
        "bench" => Args::parse(&bench::expand_short_options(rest), bench::FLAGS)
            .and_then(|a| bench::run(&a)),
        "quantize" => Args::parse(rest, quantize::FLAGS).and_then(|a| quantize::run(&a)),
        "serve" => serve::exec(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    };
    if let Err(msg) = result {
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}
