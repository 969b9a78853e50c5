//! The OpenAI-compatible endpoints: request parsing and checking, the two
//! generation endpoints, and the response shapes.

pub mod chat;
pub mod completions;
pub mod error;
pub mod request;
pub mod respond;

use crate::engine_loop::{EngineHandle, Refusal, Submission};
use crate::metrics::Metrics;
use crate::options::ServerOptions;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use error::ApiError;
use nanoinfer::engine::{Constraint, RequestParams};
use nanoinfer::sampling::SamplingParams;
use std::sync::Arc;
use std::time::Instant;

/// What every handler shares.
pub struct App {
    pub engine: EngineHandle,
    pub opts: ServerOptions,
    pub metrics: Arc<Metrics>,
}

impl App {
    /// Checks the `model` field against the one this server serves.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.opts.model_name => {
                Err(ApiError::model_not_found(m, &self.opts.model_name))
            }
            _ => Ok(()),
        }
    }

    /// Puts the requests into the session, all or none.
    pub async fn submit(
        &self,
        requests: Vec<RequestParams>,
        arrived: Instant,
    ) -> Result<Submission, ApiError> {
        self.engine
            .submit(requests, arrived)
            .await
            .map_err(|refusal| match refusal {
                Refusal::Full => {
                    self.metrics.rejected("queue_full");
                    ApiError::overloaded("the server's request queue is full; retry later")
                }
                Refusal::Draining => {
                    self.metrics.rejected("shutting_down");
                    ApiError::overloaded("the server is shutting down")
                }
                Refusal::Session(e) => {
                    self.metrics.rejected("invalid");
                    match e.kind {
                        nanoinfer::ErrorKind::InvalidArgument => ApiError::bad_request(e.message),
                        _ => ApiError::internal(e.message),
                    }
                }
                Refusal::Stopped => ApiError::internal("the engine has stopped"),
            })
    }
}

/// What both generation endpoints read first: the body as the endpoint's
/// own fields and the common ones, checked.
pub struct Parsed<T> {
    pub arrived: Instant,
    pub req: T,
    pub common: request::CommonFields,
    pub shape: request::Shape,
    /// The structured-output constraint and the field it came from.
    pub constraint: Option<(Constraint, &'static str)>,
}

impl App {
    pub fn parse<T: serde::de::DeserializeOwned>(
        &self,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<Parsed<T>, ApiError> {
        let arrived = Instant::now();
        let body = read_body(self, body)?;
        let (req, common): (T, request::CommonFields) = request::parse_body(&body)?;
        self.check_model(common.model.as_deref())?;
        common.refuse_unsupported()?;
        let shape = common.shape()?;
        let constraint = common.constraint()?;
        Ok(Parsed {
            arrived,
            req,
            common,
            shape,
            constraint,
        })
    }
}

impl<T> Parsed<T> {
    /// The `n` requests (choices) of one prompt: each its own seed.
    pub fn choices<'a>(
        &'a self,
        prompt: &'a [u32],
        sampling: &'a SamplingParams,
    ) -> impl Iterator<Item = RequestParams> + 'a {
        (0..self.shape.n).map(move |i| RequestParams {
            prompt: prompt.to_vec(),
            sampling: SamplingParams {
                seed: request::seed_for_choice(sampling.seed, i),
                ..sampling.clone()
            },
            priority: self.common.priority.unwrap_or(0),
            disable_speculation: self.common.speculative == Some(false),
            constraint: self.constraint.as_ref().map(|(c, _)| c.clone()),
            ..Default::default()
        })
    }

    /// Puts the requests into the session; a refusal of the constraint
    /// names the field it came from.
    pub async fn submit(
        &self,
        app: &App,
        requests: Vec<RequestParams>,
    ) -> Result<Submission, ApiError> {
        app.submit(requests, self.arrived)
            .await
            .map_err(|e| e.about_constraint(self.constraint.as_ref().map(|(_, param)| *param)))
    }
}

/// The body, or the error for one that could not be read (too large).
pub fn read_body(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        app.metrics.rejected("bad_body");
        let mut err = ApiError::bad_request(format!(
            "the request body could not be read: {e} (the limit is {} bytes)",
            app.opts.max_body_bytes
        ));
        err.status = e.status();
        err
    })
}
