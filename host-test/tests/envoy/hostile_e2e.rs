//! A hostile client against real Envoy (2 workers) with the plugin: malformed bodies,
//! wrong types, path variants, methods, header and content-length lies, chunked and slow
//! bodies. Each case gets the status it must; nothing unvalidated reaches HolySheep; Envoy
//! serves afterwards and no VM panics.

use host_test::client::Conn;
use host_test::stack::{prompt, Stack, PATH};
use std::time::Duration;

struct Case {
    name: String,
    request: Vec<u8>,
    status: u16,
}

/// Envoy's HTTP codec refuses these before any filter runs, with its own plain answer.
fn refused_by_envoy(name: &str) -> bool {
    name.contains('#') || name.contains("\\u{7f}") || name == "header too large"
}

/// A request with this body and a truthful `content-length`.
fn post(path: &str, extra_headers: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer hostile\r\n{extra_headers}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn case(name: impl Into<String>, request: Vec<u8>, status: u16) -> Case {
    Case { name: name.into(), request, status }
}

fn with_field(field: &str, value: &str) -> String {
    format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"hi"}}],"{field}":{value}}}"#)
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("whitespace", b"  \n\t ".to_vec()),
        ("null", b"null".to_vec()),
        ("array", b"[]".to_vec()),
        ("number", b"12".to_vec()),
        ("string", br#""hello""#.to_vec()),
        ("open brace", b"{".to_vec()),
        ("empty object", b"{}".to_vec()),
        ("trailing garbage", br#"{"model":"m","messages":[{"role":"user"}]} x"#.to_vec()),
        ("invalid utf-8", b"{\"model\":\"m\xff\",\"messages\":[{\"role\":\"user\"}]}".to_vec()),
        ("raw NUL", b"{\"model\":\"m\",\0\"messages\":[]}".to_vec()),
        (
            "deep nesting",
            format!(r#"{{"model":"m","messages":[{{"role":"user","x":{}}}]}}"#, "[".repeat(70)).into_bytes(),
        ),
        ("very deep nesting", "[".repeat(20_000).into_bytes()),
        ("huge number", br#"{"model":"m","messages":[{"role":"user"}],"n":1e999}"#.to_vec()),
        ("lone surrogate", br#"{"model":"\ud800","messages":[{"role":"user"}]}"#.to_vec()),
        ("no model", br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec()),
        ("no messages", br#"{"model":"gpt-4.1"}"#.to_vec()),
        ("empty messages", br#"{"model":"gpt-4.1","messages":[]}"#.to_vec()),
        ("message not an object", br#"{"model":"gpt-4.1","messages":[1]}"#.to_vec()),
        ("message without role", br#"{"model":"gpt-4.1","messages":[{"content":"x"}]}"#.to_vec()),
        ("messages an object", br#"{"model":"gpt-4.1","messages":{"role":"user"}}"#.to_vec()),
        ("model a number", br#"{"model":1,"messages":[{"role":"user"}]}"#.to_vec()),
        ("model empty", br#"{"model":"","messages":[{"role":"user"}]}"#.to_vec()),
        ("model blank", br#"{"model":"   ","messages":[{"role":"user"}]}"#.to_vec()),
        ("model with NUL", br#"{"model":"a\u0000b","messages":[{"role":"user"}]}"#.to_vec()),
        ("model with CRLF", br#"{"model":"a\r\nx-evil: 1","messages":[{"role":"user"}]}"#.to_vec()),
        ("model with tab", br#"{"model":"a\tb","messages":[{"role":"user"}]}"#.to_vec()),
        (
            "model 5000 bytes",
            format!(r#"{{"model":"{}","messages":[{{"role":"user"}}]}}"#, "m".repeat(5000)).into_bytes(),
        ),
    ];
    for (name, body) in bodies {
        // Each on the canonical path and on a variant a server would also accept.
        cases.push(case(format!("body: {name}"), post(PATH, "", &body), 400));
        cases.push(case(
            format!("body on /v1/chat/completions/: {name}"),
            post("/v1/chat/completions/", "", &body),
            400,
        ));
    }
    let wrong_types = [
        ("temperature", r#""hot""#),
        ("temperature", "-1"),
        ("temperature", "3"),
        ("top_p", r#""all""#),
        ("n", "0"),
        ("n", "-2"),
        ("n", "1.5"),
        ("n", r#""two""#),
        ("max_tokens", "-1"),
        ("max_tokens", r#""many""#),
        ("max_completion_tokens", "-5"),
        ("stream", r#""yes""#),
        ("stream", "1"),
        ("stop", "5"),
        ("seed", r#""s""#),
        ("tools", "{}"),
        ("tools", r#""none""#),
        ("tool_choice", "5"),
        ("response_format", r#""json""#),
        ("logit_bias", "[]"),
        ("presence_penalty", r#""x""#),
        ("frequency_penalty", "{}"),
    ];
    for (field, value) in wrong_types {
        cases.push(case(format!("{field} = {value}"), post(PATH, "", with_field(field, value).as_bytes()), 400));
    }
    for path in [
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/chat//completions",
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/v1/chat/%63ompletions",
        "/v1/chat/completions?stream=true",
        "/v1/chat/completions#x",
    ] {
        cases.push(case(format!("variant {path}: bad json"), post(path, "", b"{nope"), 400));
        cases.push(case(format!("variant {path}: no model"), post(path, "", br#"{"messages":[]}"#), 400));
    }
    let big = vec![b' '; 70_000];
    cases.push(case("body over max_body_bytes", post(PATH, "", &big), 413));
    cases.push(case(
        "content-length declares too much",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-length: 99999999\r\n\r\n".to_vec(),
        413,
    ));
    let valid = prompt("hostile but valid");
    let mut short = format!("POST {PATH} HTTP/1.1\r\nhost: edge\r\ncontent-length: 10\r\n\r\n").into_bytes();
    short.extend_from_slice(valid.as_bytes());
    cases.push(case("content-length shorter than the body", short, 400));
    let chunked = |body: &[u8]| {
        let mut r = format!("POST {PATH} HTTP/1.1\r\nhost: edge\r\ntransfer-encoding: chunked\r\n\r\n").into_bytes();
        for piece in body.chunks(7) {
            r.extend(format!("{:x}\r\n", piece.len()).into_bytes());
            r.extend_from_slice(piece);
            r.extend_from_slice(b"\r\n");
        }
        r.extend_from_slice(b"0\r\n\r\n");
        r
    };
    cases.push(case("chunked, bad json", chunked(b"{\"model\":"), 400));
    cases.push(case("chunked, wrong type", chunked(with_field("n", "0").as_bytes()), 400));
    for cc in ["max-age=-1", "no-store=1, max-age=x", "\u{7f}", "max-age=99999999999999999999"] {
        cases.push(case(
            format!("cache-control {cc:?}, bad body"),
            post(PATH, &format!("cache-control: {cc}\r\n"), b"[]"),
            400,
        ));
    }
    // Header values that are not UTF-8 (Envoy lets obs-text through): the SDK's own text
    // getters panic on them.
    for (name, value) in
        [("authorization", &b"Bearer \xff\xfe"[..]), ("cache-control", b"max-age=\xe9"), ("x-tenant", b"\x80")]
    {
        for (what, body, status) in [("bad body", &b"[]"[..], 400), ("valid", valid.as_bytes(), 200)] {
            let mut r = format!("POST {PATH} HTTP/1.1\r\nhost: edge\r\n{name}: ").into_bytes();
            r.extend_from_slice(value);
            r.extend(format!("\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes());
            r.extend_from_slice(body);
            cases.push(case(format!("{name} not UTF-8, {what}"), r, status));
        }
    }
    for method in ["GET", "PUT", "DELETE", "PATCH"] {
        let r = format!(
            "{method} {PATH} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer hostile\r\ncontent-length: 0\r\n\r\n"
        );
        // Not a chat completion: passed through untouched, with the client's own key.
        cases.push(case(format!("{method} to the chat path"), r.into_bytes(), 404));
    }
    cases.push(case(
        "header too large",
        format!("POST {PATH} HTTP/1.1\r\nhost: edge\r\nx-big: {}\r\ncontent-length: 2\r\n\r\n{{}}", "a".repeat(70_000))
            .into_bytes(),
        431,
    ));
    cases
}

#[test]
fn a_hundred_hostile_requests_get_their_statuses_and_nothing_unvalidated_reaches_holysheep() {
    let s = Stack::start(r#"{"max_body_bytes":65536,"cache":{"tenant_header":"x-tenant"}}"#, 0);
    let cases = cases();
    assert!(cases.len() >= 100, "{} cases", cases.len());
    let (mut wrong, mut misses) = (Vec::new(), 0u64);
    for c in &cases {
        let got = Conn::open(s.envoy.edge)
            .and_then(|conn| conn.read_timeout(Duration::from_secs(20)))
            .and_then(|mut conn| conn.raw(&c.request));
        match got {
            Ok(r) if r.status == c.status => {
                misses += u64::from(r.status == 200 && r.cache() == "MISS");
                if (r.status == 400 || r.status == 413) && !refused_by_envoy(&c.name) {
                    let code = r.json()["error"]["message"].is_string();
                    if !code {
                        wrong.push(format!("{}: not OpenAI-shaped: {}", c.name, r.text()));
                    }
                }
            }
            Ok(r) => wrong.push(format!("{}: {} (wanted {}) {}", c.name, r.status, c.status, r.text())),
            Err(e) => wrong.push(format!("{}: {e}", c.name)),
        }
    }
    assert!(wrong.is_empty(), "{} of {} cases:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
    // Every call HolySheep got is a valid case's MISS (the others were HITs of those).
    assert_eq!(s.calls(), misses, "no chat completion reached HolySheep unvalidated");
    // A slow body (pieces 50 ms apart) is read whole, then governed.
    let body = prompt("slow but valid");
    let mut slow = Conn::open(s.envoy.edge).expect("connect");
    let head = format!("POST {PATH} HTTP/1.1\r\nhost: edge\r\ncontent-length: {}\r\n\r\n", body.len());
    let mut pieces: Vec<Vec<u8>> = vec![head.into_bytes()];
    pieces.extend(body.as_bytes().chunks(16).map(<[u8]>::to_vec));
    let last = pieces.pop().unwrap_or_default();
    for p in pieces {
        slow.send_raw_part(&p).expect("write");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = slow.raw(&last).expect("answer");
    assert_eq!((r.status, r.cache()), (200, "MISS"), "{}", r.text());
    assert_eq!(s.crashes(), Vec::<String>::new(), "no VM crashed");
    assert_eq!(s.chat(&prompt("after the hostile suite"), &[]).status, 200, "Envoy still serves");
}
