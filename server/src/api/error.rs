//! OpenAI-shaped error responses: `{"error": {"message", "type", "param",
//! "code"}}` with the status code a client's retry logic expects.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (503 only).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A bad value in the request; `param` names the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.into());
        e
    }

    /// A request the session refused without naming a field.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// The prompt (with the tokens asked for) does not fit.
    pub fn context_length(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::invalid(param, message);
        e.code = Some("context_length_exceeded");
        e
    }

    pub fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::invalid(param, message);
        e.code = Some("unsupported_parameter");
        e
    }

    pub fn model_not_found(requested: &str, served: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{requested}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn unauthorized() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Missing or incorrect API key: send `Authorization: Bearer <key>`",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn overloaded(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_overloaded",
            message,
        );
        e.retry_after = Some(1);
        e
    }

    pub fn timeout(seconds: f64) -> ApiError {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            format!("the request ran longer than the server's --request-timeout of {seconds} s and was cancelled"),
        )
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route for `{path}`"),
        )
    }

    /// A session refusal of a structured-output request names the field
    /// the constraint came from (the engine's message names the problem).
    pub fn about_constraint(mut self, param: Option<&'static str>) -> ApiError {
        if self.status == StatusCode::BAD_REQUEST && self.param.is_none() {
            self.param = param.map(str::to_string);
        }
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}
