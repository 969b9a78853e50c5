//! The server's own command-line options, and the request defaults taken
//! from the sampling options on the command line.

use crate::args::Args;
use crate::session_opts::{MODEL_OPTS, SESSION_OPTS};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

/// Options that take no value.
pub const FLAGS: &[&str] = &["no-prefix-cache", "host-sampling"];

const SERVER_OPTS: &[&str] = &[
    "host",
    "port",
    "api-key",
    "served-model-name",
    "max-queue",
    "request-timeout",
    "max-body-bytes",
    "shutdown-timeout",
];

/// Sampling options that set the defaults of requests that leave them out.
const DEFAULT_SAMPLING_OPTS: &[&str] = &[
    "temperature",
    "top-k",
    "top-p",
    "min-p",
    "repetition-penalty",
    "seed",
    "max-tokens",
];

/// Largest request body accepted by default: far above any prompt the
/// default context holds, far below what would strain the host.
const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// The most a caller may raise it to.
const MAX_BODY_BYTES_LIMIT: usize = 256 << 20;

pub struct ServerOptions {
    pub addr: SocketAddr,
    pub api_key: Option<String>,
    pub model_name: String,
    /// Requests accepted beyond the running ones; `None`: 4 x max_seqs.
    pub max_queue: Option<usize>,
    pub request_timeout: Option<Duration>,
    pub max_body_bytes: usize,
    pub shutdown_timeout: Duration,
    pub defaults: RequestDefaults,
}

/// What a request gets for a sampling field it leaves out. OpenAI's
/// defaults (temperature 1, top_p 1) unless the command line says otherwise.
#[derive(Clone, Debug)]
pub struct RequestDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// `None`: up to the request's token limit.
    pub max_tokens: Option<u32>,
}

impl ServerOptions {
    pub fn from_args(a: &Args) -> Result<ServerOptions, String> {
        let known = [
            MODEL_OPTS,
            SESSION_OPTS,
            FLAGS,
            SERVER_OPTS,
            DEFAULT_SAMPLING_OPTS,
        ]
        .concat();
        a.check_known(&known)?;
        let host: IpAddr = a.parse_or("host", IpAddr::from([127, 0, 0, 1]))?;
        let port: u16 = a.parse_or("port", 8080)?;
        let api_key = a
            .get("api-key")
            .map(str::to_string)
            .or_else(|| std::env::var("NANOINFER_API_KEY").ok())
            .filter(|k| !k.is_empty());
        let model_dir = a.get("model").ok_or("--model DIR is required")?;
        let model_name = match a.get("served-model-name") {
            Some(n) if !n.is_empty() => n.to_string(),
            Some(_) => return Err("--served-model-name must not be empty".into()),
            None => Path::new(model_dir.trim_end_matches('/'))
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "default".into()),
        };
        let max_body_bytes = a.parse_or("max-body-bytes", DEFAULT_MAX_BODY_BYTES)?;
        if !(1024..=MAX_BODY_BYTES_LIMIT).contains(&max_body_bytes) {
            return Err(format!(
                "--max-body-bytes must be between 1024 and {MAX_BODY_BYTES_LIMIT}, got {max_body_bytes}"
            ));
        }
        let secs = |name: &str, default: f64| -> Result<f64, String> {
            let v: f64 = a.parse_or(name, default)?;
            if !(0.0..=1e7).contains(&v) {
                return Err(format!(
                    "--{name} must be between 0 and 1e7 seconds, got {v}"
                ));
            }
            Ok(v)
        };
        let request_timeout = match secs("request-timeout", 600.0)? {
            0.0 => None,
            s => Some(Duration::from_secs_f64(s)),
        };
        let max_queue = a
            .get("max-queue")
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|e| format!("invalid value `{v}` for --max-queue: {e}"))
            })
            .transpose()?;
        if max_queue.is_some_and(|q| q > 1_000_000) {
            return Err("--max-queue must be at most 1000000".into());
        }
        Ok(ServerOptions {
            addr: SocketAddr::new(host, port),
            api_key,
            model_name,
            max_queue,
            request_timeout,
            max_body_bytes,
            shutdown_timeout: Duration::from_secs_f64(secs("shutdown-timeout", 30.0)?),
            defaults: RequestDefaults {
                temperature: a.parse_or("temperature", 1.0)?,
                top_p: a.parse_or("top-p", 1.0)?,
                top_k: a.parse_or("top-k", 0)?,
                min_p: a.parse_or("min-p", 0.0)?,
                repetition_penalty: a.parse_or("repetition-penalty", 1.0)?,
                seed: a
                    .get("seed")
                    .map(|s| s.parse().map_err(|e| format!("invalid --seed `{s}`: {e}")))
                    .transpose()?,
                max_tokens: a
                    .get("max-tokens")
                    .map(|s| {
                        s.parse()
                            .map_err(|e| format!("invalid --max-tokens `{s}`: {e}"))
                    })
                    .transpose()?,
            },
        })
    }
}
