//! What `/metrics` reports, in Prometheus text format: queue and KV
//! occupancy, prefix-cache reuse, token throughput, and time-to-first-token
//! and inter-token latency histograms. Written by the engine thread (and by
//! handlers for refusals); read by the scraper.

use nanoinfer::engine::{FinishReason, SessionStats, Usage};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

type Labels = Vec<(&'static str, &'static str)>;
type RatioGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    waiting: Gauge,
    running: Gauge,
    in_flight: Gauge,
    kv_usage: RatioGauge,
    kv_used_tokens: Gauge,
    spec_draft_tokens: Gauge,
    spec_accepted_tokens: Gauge,
    prefix_hit_ratio: RatioGauge,
    prompt_tokens: Counter,
    cached_prompt_tokens: Counter,
    generated: Counter,
    tokens_per_second: RatioGauge,
    accepted: Counter,
    finished: Family<Labels, Counter>,
    rejected: Family<Labels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    /// Generated-token count and time at the start of the throughput window.
    window: Mutex<(u64, Instant)>,
}

/// Latency buckets in seconds: 1 ms to about 65 s, doubling.
fn latency_buckets() -> impl Iterator<Item = f64> {
    (0..17).map(|i| 0.001 * f64::from(1u32 << i))
}

/// The throughput gauge averages over windows at least this long.
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(1);

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("nanoinfer");
        macro_rules! reg {
            ($name:expr, $help:expr, $metric:expr) => {{
                let m = $metric;
                registry.register($name, $help, m.clone());
                m
            }};
        }
        Metrics {
            waiting: reg!(
                "requests_waiting",
                "Requests queued in the session, not yet running",
                Gauge::default()
            ),
            running: reg!(
                "requests_running",
                "Requests running in the session",
                Gauge::default()
            ),
            in_flight: reg!(
                "requests_in_flight",
                "Requests accepted by the server and not yet ended (the bounded queue's fill)",
                Gauge::default()
            ),
            kv_usage: reg!(
                "kv_cache_usage_ratio",
                "Fraction of the KV cache's slots held by live requests",
                RatioGauge::default()
            ),
            kv_used_tokens: reg!(
                "kv_cache_used_tokens",
                "KV cache slots held by live requests",
                Gauge::default()
            ),
            spec_draft_tokens: reg!(
                "spec_draft_tokens",
                "Speculative decoding: tokens drafted and verified since the server started",
                Gauge::default()
            ),
            spec_accepted_tokens: reg!(
                "spec_accepted_tokens",
                "Speculative decoding: drafted tokens the model kept since the server started",
                Gauge::default()
            ),
            prefix_hit_ratio: reg!(
                "prefix_cache_hit_ratio",
                "Prompt tokens whose KV the prefix cache supplied, over all prompt tokens of finished requests",
                RatioGauge::default()
            ),
            prompt_tokens: reg!(
                "prompt_tokens",
                "Prompt tokens of finished requests",
                Counter::default()
            ),
            cached_prompt_tokens: reg!(
                "cached_prompt_tokens",
                "Prompt tokens of finished requests taken from the prefix cache",
                Counter::default()
            ),
            generated: reg!(
                "generation_tokens",
                "Tokens generated",
                Counter::default()
            ),
            tokens_per_second: reg!(
                "generation_tokens_per_second",
                "Tokens generated per second over the last second of work",
                RatioGauge::default()
            ),
            accepted: reg!(
                "requests_accepted",
                "Requests accepted into the session (one per choice)",
                Counter::default()
            ),
            finished: reg!(
                "requests_finished",
                "Requests ended, by finish reason",
                Family::default()
            ),
            rejected: reg!(
                "requests_rejected",
                "HTTP requests refused before reaching the session, by reason",
                Family::default()
            ),
            ttft: reg!(
                "time_to_first_token_seconds",
                "From the request's arrival to its first generated token",
                Histogram::new(latency_buckets())
            ),
            itl: reg!(
                "inter_token_latency_seconds",
                "Between consecutive generated tokens of a request",
                Histogram::new(latency_buckets())
            ),
            e2e: reg!(
                "request_latency_seconds",
                "From the request's arrival to its end",
                Histogram::new(latency_buckets())
            ),
            window: Mutex::new((0, Instant::now())),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self, in_flight: usize) -> String {
        self.in_flight.set(in_flight as i64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn observe_step(&self, stats: &SessionStats) {
        self.occupancy(stats);
        let mut window = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = window.1.elapsed();
        if elapsed >= THROUGHPUT_WINDOW {
            let total = self.generated.get();
            self.tokens_per_second
                .set((total - window.0) as f64 / elapsed.as_secs_f64());
            *window = (total, Instant::now());
        }
    }

    pub fn observe_idle(&self, stats: &SessionStats) {
        self.occupancy(stats);
        self.tokens_per_second.set(0.0);
        *self.window.lock().unwrap_or_else(|p| p.into_inner()) =
            (self.generated.get(), Instant::now());
    }

    fn occupancy(&self, stats: &SessionStats) {
        self.waiting.set(stats.waiting as i64);
        self.running.set(stats.running as i64);
        self.kv_used_tokens.set(stats.kv.used_slots as i64);
        self.spec_draft_tokens.set(stats.spec_draft_tokens as i64);
        self.spec_accepted_tokens
            .set(stats.spec_accepted_tokens as i64);
        self.kv_usage
            .set(stats.kv.used_slots as f64 / stats.kv.total_slots.max(1) as f64);
    }

    pub fn requests_accepted(&self, n: usize) {
        self.accepted.inc_by(n as u64);
    }

    pub fn observe_first_token(&self, since_arrival: Duration) {
        self.ttft.observe(since_arrival.as_secs_f64());
    }

    /// `tokens` arrived together `gap` after the previous ones.
    pub fn observe_inter_token(&self, gap: Duration, tokens: usize) {
        let each = gap.as_secs_f64() / tokens.max(1) as f64;
        for _ in 0..tokens {
            self.itl.observe(each);
        }
    }

    pub fn generated_tokens(&self, n: usize) {
        self.generated.inc_by(n as u64);
    }

    pub fn request_finished(&self, reason: &FinishReason, usage: Usage, latency: Duration) {
        let name = crate::engine_loop::finish_reason_name(reason);
        self.finished.get_or_create(&vec![("reason", name)]).inc();
        self.e2e.observe(latency.as_secs_f64());
        self.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        self.cached_prompt_tokens
            .inc_by(usage.cached_prompt_tokens as u64);
        self.prefix_hit_ratio
            .set(self.cached_prompt_tokens.get() as f64 / self.prompt_tokens.get().max(1) as f64);
    }

    /// An HTTP request refused before the session saw it.
    pub fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&vec![("reason", reason)]).inc();
    }
}
