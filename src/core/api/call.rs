//! An HTTP call the edge asks its host to make (to HolySheep, or to an owner node): the
//! cluster it goes to, every header it carries, its body and its deadline. The host sends
//! it as it is and hands the answer back; it adds nothing but the framing its HTTP client
//! needs (a `content-length` where the client does not set one).

use crate::core::api::headers;

/// A call, ready to send. Its `Debug` hides the values of the headers that carry a
/// secret (the operator's key, the fleet's secret).
#[derive(Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// The Envoy cluster it goes to (a host without clusters sends it to `:authority`).
    pub cluster: String,
    /// `:method`, `:path` and `:authority` first, then the headers it carries.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Its deadline from when it is sent, at least 1 ms.
    pub timeout_ms: u64,
}

impl std::fmt::Debug for HttpCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = |n: &str| n == headers::AUTHORIZATION || n == headers::PEER_SECRET;
        let shown: Vec<(&str, &str)> =
            self.headers.iter().map(|(n, v)| (*n, if secret(n) { "(hidden)" } else { v.as_str() })).collect();
        f.debug_struct("HttpCall")
            .field("cluster", &self.cluster)
            .field("headers", &shown)
            .field("body_bytes", &self.body.len())
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

impl HttpCall {
    /// A `POST` of `body` to `path` at `authority`, along `cluster`.
    pub(crate) fn post<'a>(
        to: (&str, &str),
        path: &str,
        headers: impl IntoIterator<Item = (&'static str, &'a str)>,
        body: Vec<u8>,
        timeout_ms: u64,
    ) -> HttpCall {
        HttpCall::request("POST", to, path, headers, body, timeout_ms)
    }

    /// A request of `method` to `path` at `authority`, along `cluster` (`body`: none when
    /// empty).
    pub(crate) fn request<'a>(
        method: &str,
        (cluster, authority): (&str, &str),
        path: &str,
        headers: impl IntoIterator<Item = (&'static str, &'a str)>,
        body: Vec<u8>,
        timeout_ms: u64,
    ) -> HttpCall {
        let pseudo = [(":method", method), (":path", path), (":authority", authority)].map(|(n, v)| (n, v.to_owned()));
        let all = pseudo.into_iter().chain(headers.into_iter().map(|(n, v)| (n, v.to_owned()))).collect();
        HttpCall { cluster: cluster.to_owned(), headers: all, body, timeout_ms: timeout_ms.max(1) }
    }

    /// Its headers as pairs of names and values, in order.
    pub fn pairs(&self) -> Vec<(&str, &str)> {
        self.headers.iter().map(|(n, v)| (*n, v.as_str())).collect()
    }

    /// The value of header `name` (the first, when it repeats).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    /// The headers after the pseudo-headers.
    pub fn regular(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.headers.iter().filter(|(n, _)| !n.starts_with(':')).map(|(n, v)| (*n, v.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_post_names_its_method_path_and_authority_first_and_never_has_no_deadline() {
        let call =
            HttpCall::post(("c", "api.example"), "/v1/x", [("content-type", "application/json")], b"{}".to_vec(), 0);
        assert_eq!(call.pairs()[..3], [(":method", "POST"), (":path", "/v1/x"), (":authority", "api.example")]);
        assert_eq!(call.header("content-type"), Some("application/json"));
        assert_eq!(call.regular().collect::<Vec<_>>(), [("content-type", "application/json")]);
        assert_eq!((call.cluster.as_str(), call.timeout_ms), ("c", 1));
        let keyed = HttpCall::post(
            ("c", "a"),
            "/",
            [("authorization", "Bearer sk-9"), ("x-holysheep-peer-secret", "s3")],
            Vec::new(),
            5,
        );
        let shown = format!("{keyed:?}");
        assert!(!shown.contains("sk-9") && !shown.contains("s3") && shown.contains("(hidden)"), "{shown}");
    }
}
