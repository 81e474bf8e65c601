//! OpenAI-shaped API errors: the one place error bodies are rendered.

use crate::core::wire::json;
use crate::core::wire::write;
use serde_json::Value;

/// An error answered to the client as `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: &'static str,
}

impl ApiError {
    /// OpenAI's 401 for a key it does not know; the token is never quoted.
    pub fn invalid_api_key() -> Self {
        ApiError {
            status: 401,
            message: "Incorrect API key provided. Send the key this edge issued you as 'Authorization: Bearer <key>'."
                .into(),
            kind: "invalid_request_error",
            param: None,
            code: "invalid_api_key",
        }
    }

    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>, code: &'static str) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code,
        }
    }

    /// A 413: the request body is larger than `max_body_bytes`.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: 413,
            message: format!("request body is larger than the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: "request_too_large",
        }
    }

    /// A 400: the call's tokens (its prompt, and `max_tokens` for each choice) are more than
    /// the `what` allows in a minute, so it could never be admitted.
    pub(crate) fn too_many_tokens(what: &str, estimate: u64, tpm: u64) -> Self {
        ApiError::invalid(
            format!(
                "This request may use up to {estimate} tokens (its prompt, and max_tokens for each choice), more \
                 than the {tpm} tokens per minute {what} allows: it could never be sent. Lower max_tokens (or n)."
            ),
            Some("max_tokens"),
            "tokens_over_limit",
        )
    }

    /// A 404 for a path the edge does not serve (OpenAI's wording and code).
    pub fn not_found(method: &str, path: &str) -> Self {
        let path: String = path.chars().take(256).collect();
        ApiError {
            status: 404,
            message: format!("Unknown request URL: {method} {path}."),
            kind: "invalid_request_error",
            param: None,
            code: "unknown_url",
        }
    }

    /// A 404 for a path a tenant sent that the edge neither governs nor lets pass
    /// (`passthrough_paths`).
    pub(crate) fn not_served(method: &str, path: &str) -> Self {
        let path: String = path.chars().filter(|c| !c.is_control()).take(256).collect();
        ApiError {
            status: 404,
            message: format!(
                "{method} {path} is not served through this edge: it governs chat completions, completions, \
                 embeddings and responses (POST), and lists models."
            ),
            kind: "invalid_request_error",
            param: None,
            code: "unknown_url",
        }
    }

    /// A 403: the caller may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError { status: 403, message: message.into(), kind: "invalid_request_error", param: None, code: "forbidden" }
    }

    /// A 421: the route Envoy chose for a governed stream leads elsewhere than HolySheep,
    /// so the edge does not send it with its key.
    pub fn misdirected() -> Self {
        ApiError {
            status: 421,
            message: "this edge sends chat completions only to its configured upstream, and this request's route \
                      leads elsewhere (check the Host header)"
                .into(),
            kind: "invalid_request_error",
            param: None,
            code: "misdirected_request",
        }
    }

    /// A 5xx produced by the edge itself when HolySheep could not be reached.
    pub fn upstream(status: u16, message: impl Into<String>, code: &'static str) -> Self {
        ApiError { status, message: message.into(), kind: "upstream_error", param: None, code }
    }

    /// A 503 for a request that waited on an identical request's call and could not read
    /// how that call ended: the edge does not call again on its behalf (the first call
    /// may have been answered and billed); the client may retry.
    pub(crate) fn wait_lost() -> Self {
        ApiError {
            status: 503,
            message: "the identical request this one waited on ended, and its answer could no longer be read; retry"
                .into(),
            kind: "server_error",
            param: None,
            code: "wait_lost",
        }
    }

    /// A 500 `server_error`: the edge itself is misconfigured or lost its store.
    pub fn server(message: impl Into<String>, code: &'static str) -> Self {
        ApiError { status: 500, message: message.into(), kind: "server_error", param: None, code }
    }

    pub fn body(&self) -> Vec<u8> {
        let error = json::object([
            ("message", Value::from(self.message.as_str())),
            ("type", Value::from(self.kind)),
            ("param", self.param.as_deref().map_or(Value::Null, Value::from)),
            ("code", Value::from(self.code)),
        ]);
        write::value(&json::object([("error", error)]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid("bad", Some("model"), "invalid_type");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["message"], "bad");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "invalid_type");
        let e = ApiError::too_large(10);
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert!(v["error"]["param"].is_null());
        assert_eq!(e.status, 413);
    }
}
