//! Any body: parsing never panics; an accepted request has a key that does not depend on
//! the fields left out of it, and a path check that never panics either.
#![no_main]

use holysheep_edge::core::config::Config;
use holysheep_edge::core::api::endpoint::{self, Endpoint};
use holysheep_edge::core::request::{is_chat_path, ApiRequest, RequestMeta};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let config = Config::default();
    let meta = RequestMeta { authorization: Some("Bearer f"), ..RequestMeta::default() };
    let _ = is_chat_path(&String::from_utf8_lossy(data));
    let _ = Endpoint::of_path(&String::from_utf8_lossy(data));
    let kind = endpoint::ALL[usize::from(data.first().copied().unwrap_or(0) % 4)];
    let Ok(request) = ApiRequest::parse(&config, &meta, kind, data) else { return };
    let Ok(serde_json::Value::Object(mut map)) = serde_json::from_slice::<serde_json::Value>(data) else {
        panic!("accepted a body that is not a JSON object");
    };
    map.insert("stream".into(), serde_json::Value::Bool(!request.stream));
    map.insert("user".into(), serde_json::Value::String("someone else".into()));
    let again = serde_json::to_vec(&map).unwrap_or_default();
    if let Ok(other) = ApiRequest::parse(&config, &meta, kind, &again) {
        assert_eq!(other.key, request.key, "stream and user must not change the key");
    }
});
