//! The HTTP surface: routes, the API key check, the small endpoints
//! (models, health, metrics, the chat page), and serving with a graceful
//! shutdown.

use crate::api::error::ApiError;
use crate::api::{chat, completions, App};
use crate::engine_loop::EngineHandle;
use crate::metrics::Metrics;
use crate::options::ServerOptions;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHAT_PAGE: &str = include_str!("../static/chat.html");

pub fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .layer(middleware::from_fn_with_state(app.clone(), require_api_key));
    Router::new()
        .merge(v1)
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(app.opts.max_body_bytes))
        .with_state(app)
}

/// `Authorization: Bearer KEY` when the server has a key. The comparison
/// takes the same time wherever the key differs.
async fn require_api_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.opts.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
            app.metrics.rejected("unauthorized");
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn models(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.opts.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "nanoinfer",
            "max_model_len": app.engine.facts.request_token_limit,
        }],
    }))
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.engine.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(app.engine.in_flight()),
    )
        .into_response()
}

async fn page() -> Html<&'static str> {
    Html(CHAT_PAGE)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(req.uri().path())
}

/// Serves until SIGTERM or Ctrl-C, then drains: no new requests, running
/// ones get `shutdown_timeout` to finish, the rest are cancelled (their
/// clients get their terminal events), and the engine thread stops.
pub async fn serve(
    opts: ServerOptions,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
) -> Result<(), String> {
    let addr = opts.addr;
    let grace = opts.shutdown_timeout;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("cannot read the listening address: {e}"))?;
    let app = Arc::new(App {
        engine: engine.clone(),
        opts,
        metrics,
    });
    // Tests and scripts wait for this line (and read the port from it with --port 0).
    eprintln!(
        "nanoinfer serve: listening on http://{local} (model `{}`)",
        app.opts.model_name
    );
    let drain_engine = engine.clone();
    let shutdown = async move {
        wait_for_signal().await;
        eprintln!(
            "nanoinfer serve: shutting down; {} request(s) in flight get {} s to finish",
            drain_engine.in_flight(),
            grace.as_secs_f64()
        );
        drain_engine.start_draining();
        let started = Instant::now();
        // After the grace period the rest are cancelled; their streams end
        // and the server's connections close.
        tokio::spawn(async move {
            while drain_engine.in_flight() > 0 && started.elapsed() < grace {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if drain_engine.in_flight() > 0 {
                eprintln!(
                    "nanoinfer serve: cancelling {} request(s)",
                    drain_engine.in_flight()
                );
                drain_engine.cancel_all();
            }
        });
    };
    axum::serve(listener, router(app))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| format!("server error: {e}"))?;
    eprintln!("nanoinfer serve: stopped");
    Ok(())
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}
