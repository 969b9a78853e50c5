//! `nanoinfer-serve` (run as `nanoinfer serve`): an OpenAI-compatible HTTP
//! server and a chat page over one NanoInfer session.
//!
//! One engine thread owns the session and steps it (engine_loop.rs); HTTP
//! handlers on the tokio runtime only tokenize, submit and forward events,
//! so a slow or vanished client never holds up a step. This crate is apart
//! from `libnanoinfer` so that the embeddable library neither builds nor
//! links tokio and axum.

// The command line is the CLI's own parser and session options, shared
// rather than copied so that `generate` and `serve` accept the same flags.
#[path = "../../src/bin/nanoinfer/args.rs"]
mod args;
#[path = "../../src/bin/nanoinfer/session_opts.rs"]
#[allow(dead_code)] // `generate`-only helpers this binary does not call
mod session_opts;

mod api;
mod engine_loop;
mod metrics;
mod options;
mod routes;

use args::Args;
use std::sync::Arc;

const USAGE: &str = "usage:
  nanoinfer serve --model DIR [--host 127.0.0.1] [--port 8080] [--api-key KEY]
                  [--served-model-name NAME] [--max-queue N] [--request-timeout SECS]
                  [--max-body-bytes N] [--shutdown-timeout SECS]
                  [model and session options of `nanoinfer generate`: --device --threads --dtype
                   --quant --kv-backend --kv-capacity --memory-utilization --max-seqs ...]
                  [default sampling: --temperature --top-k --top-p --min-p --repetition-penalty
                   --seed --max-tokens]
  Serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
  GET /health, GET /metrics (Prometheus) and a chat page at /.
  --api-key (or NANOINFER_API_KEY) requires `Authorization: Bearer KEY` on /v1/*.
  --max-queue: requests accepted beyond the running ones (default 4 x --max-seqs);
  more get 503 with Retry-After. SIGTERM or Ctrl-C stops accepting, lets running
  requests finish for --shutdown-timeout seconds (default 30), then cancels the rest.";

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv
        .iter()
        .any(|a| a == "-h" || a == "--help" || a == "help")
    {
        println!("{USAGE}");
        return;
    }
    let result = Args::parse(&argv, options::FLAGS).and_then(|a| run(&a));
    if let Err(msg) = result {
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<(), String> {
    let opts = options::ServerOptions::from_args(a)?;
    let model = session_opts::load_model(a)?;
    let session = session_opts::session_params(a)?;
    let metrics = Arc::new(metrics::Metrics::new());
    let engine = engine_loop::EngineHandle::start(model, session, opts.max_queue, metrics.clone())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("nanoinfer-http")
        .build()
        .map_err(|e| format!("cannot start the HTTP runtime: {e}"))?;
    runtime.block_on(routes::serve(opts, engine, metrics))
}
