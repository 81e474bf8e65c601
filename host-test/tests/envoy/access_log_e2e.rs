//! Per-request fields in Envoy's access log: the JSON access log of `envoy/production.yaml`
//! on the edge listener of a real Envoy (2 workers), and what it prints for a MISS, its
//! COALESCED followers, a HIT and a 429, on the plugin and on the native module.

use host_test::client::Resp;
use host_test::envoy::Shell;
use host_test::stack::key_digest;
use host_test::stack::{poll_until, prompt, prompt_for, streamed, Stack};
use serde_json::Value;
use std::path::PathBuf;

const OPERATOR: &str = "sk-operator-log-7d1e";
const SEARCH: &str = "hs-search-log-2c9a";

fn lines(path: &PathBuf) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// A field as text (Envoy writes numbers for some, strings for others).
fn field(line: &Value, name: &str) -> String {
    match &line[name] {
        Value::String(s) => s.clone(),
        Value::Null => "(absent)".to_owned(),
        v => v.to_string(),
    }
}

#[test]
fn the_access_log_shows_each_answers_cache_models_tokens_cost_and_wait() {
    the_access_log_shows_each_answer(Shell::Wasm);
}

#[test]
fn the_native_modules_access_log_shows_the_same() {
    the_access_log_shows_each_answer(Shell::Native);
}

fn the_access_log_shows_each_answer(shell: Shell) {
    let log = std::env::temp_dir().join(format!("holysheep-access-{}-{shell:?}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let config = format!(
        r#"{{"log_fields":true,"models":{{"gpt-4.1":{{"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0}},
                        "deepseek-v3":{{"requests_per_minute":1,"burst":1}}}},
            "tenants":{{"search":{{"keys_sha256":["{}"],"priority":"critical"}}}}}}"#,
        key_digest(SEARCH)
    );
    let s = Stack::start_tuned(
        &config,
        300,
        |o| {
            o.api_key = Some(OPERATOR.into());
            o.shipped_access_log = Some(log.clone());
            o.shell = shell;
        },
        Some(OPERATOR),
    );
    let auth = format!("Bearer {SEARCH}");
    let body = prompt("what the access log says");
    let crowd: Vec<Resp> = s.burst(3, &body, &auth);
    assert!(crowd.iter().all(|r| r.status == 200));
    let hit = s.chat(&body, &[("authorization", &auth)]);
    assert_eq!(hit.cache(), "HIT");
    let first = s.chat(&prompt_for("deepseek-v3", "one"), &[("authorization", &auth)]);
    let limited = s.chat(&prompt_for("deepseek-v3", "two"), &[("authorization", &auth)]);
    assert_eq!((first.status, limited.status), (200, 429));
    poll_until(|| lines(&log).len() >= 6, "six access-log lines never came");
    let logged = lines(&log);
    assert_eq!(logged.len(), 6, "{logged:#?}");

    let usage = &crowd.iter().find(|r| r.cache() == "MISS").expect("a MISS").json()["usage"];
    let (input, output) =
        (usage["prompt_tokens"].as_u64().unwrap_or(0), usage["completion_tokens"].as_u64().unwrap_or(0));
    assert!(input > 0 && output > 0, "{usage}");
    let cost = (input * 2 + output * 8) as f64 / 1e6;
    let key = hit.header("x-holysheep-key").expect("a key").to_owned();
    let by = |cache: &str, model: &str| -> Vec<&Value> {
        logged
            .iter()
            .filter(|l| field(l, "holysheep.cache") == cache && field(l, "gen_ai.request.model") == model)
            .collect()
    };
    for line in &logged {
        assert_eq!(
            (field(line, "holysheep.tenant"), field(line, "holysheep.priority")),
            ("search".into(), "critical".into())
        );
        assert!(!line.to_string().contains(SEARCH) && !line.to_string().contains(OPERATOR), "no key logged: {line}");
    }

    let miss = by("MISS", "gpt-4.1");
    assert_eq!(miss.len(), 1, "{logged:#?}");
    let miss = miss[0];
    assert_eq!((field(miss, "status"), field(miss, "gen_ai.operation.name")), ("200".into(), "chat".into()));
    assert_eq!((field(miss, "gen_ai.response.model"), field(miss, "holysheep.key")), ("gpt-4.1".into(), key.clone()));
    assert_eq!(
        (field(miss, "gen_ai.usage.input_tokens"), field(miss, "gen_ai.usage.output_tokens")),
        (input.to_string(), output.to_string())
    );
    assert_eq!(field(miss, "holysheep.cost_usd"), format!("{cost:.6}"), "what the call cost");
    assert_eq!(field(miss, "holysheep.upstream_attempts"), "1");
    let (waited, took): (u64, u64) =
        (field(miss, "holysheep.wait_ms").parse().unwrap_or(u64::MAX), field(miss, "duration_ms").parse().unwrap_or(0));
    assert!(
        waited + 300 <= took,
        "the leader's wait for admission ({waited} ms) is apart from its 300 ms call ({took} ms)"
    );

    let coalesced = by("COALESCED", "gpt-4.1");
    assert_eq!(coalesced.len(), 2, "{logged:#?}");
    for line in coalesced {
        assert_eq!(
            (field(line, "holysheep.key"), field(line, "gen_ai.usage.output_tokens")),
            (key.clone(), output.to_string())
        );
        assert_eq!(
            (field(line, "holysheep.upstream_attempts"), field(line, "holysheep.cost_usd")),
            ("0".into(), "0.000000".into()),
            "nothing of its own"
        );
        let waited: u64 = field(line, "holysheep.wait_ms").parse().unwrap_or(0);
        let took: u64 = field(line, "duration_ms").parse().unwrap_or(0);
        // Envoy's clock for wasm advances once per event-loop turn: within 50 ms of the log's.
        assert!(waited <= took + 50, "waited {waited} ms of {took} ms for the flight");
    }

    let hits = by("HIT", "gpt-4.1");
    assert_eq!(hits.len(), 1);
    assert_eq!(
        (field(hits[0], "gen_ai.usage.input_tokens"), field(hits[0], "holysheep.cost_usd")),
        (input.to_string(), "0.000000".into())
    );
    assert_eq!(
        (field(hits[0], "holysheep.upstream_attempts"), field(hits[0], "holysheep.wait_ms")),
        ("0".into(), "0".into())
    );

    let refused: Vec<&Value> = by("MISS", "deepseek-v3").into_iter().filter(|l| field(l, "status") == "429").collect();
    assert_eq!(refused.len(), 1, "{logged:#?}");
    let r = refused[0];
    assert_eq!(
        (field(r, "gen_ai.response.model"), field(r, "gen_ai.usage.input_tokens")),
        ("(absent)".into(), "(absent)".into()),
        "no answer, no tokens: not set, Envoy writes null"
    );
    assert_eq!(
        (field(r, "holysheep.upstream_attempts"), field(r, "holysheep.cost_usd")),
        ("0".into(), "0.000000".into())
    );

    // Another endpoint is logged as its own operation, with its input tokens.
    let embedding = br#"{"model":"text-embedding-3-small","input":"three little words"}"#;
    let e = host_test::client::request(s.envoy.edge, "POST", "/v1/embeddings", &[("authorization", &auth)], embedding)
        .expect("an answer");
    assert_eq!(e.status, 200, "{}", e.text());
    poll_until(|| lines(&log).len() >= 7, "the embedding's access-log line never came");
    let line = lines(&log).pop().expect("a line");
    assert_eq!(
        (field(&line, "gen_ai.operation.name"), field(&line, "path"), field(&line, "gen_ai.usage.input_tokens")),
        ("embeddings".into(), "/v1/embeddings".into(), "3".into())
    );
    // A streamed MISS is logged with its stream's usage (published before its end).
    let stream = s.chat(&streamed(&prompt("a logged stream")), &[("authorization", &auth)]);
    assert_eq!((stream.status, stream.cache()), (200, "MISS"));
    poll_until(|| lines(&log).len() >= 8, "the stream's access-log line never came");
    let line = lines(&log).pop().expect("a line");
    assert_eq!(field(&line, "holysheep.cache"), "MISS", "{line}");
    assert!(field(&line, "gen_ai.usage.output_tokens").parse::<u64>().is_ok_and(|n| n > 0), "{line}");
    assert!(s.crashes().is_empty(), "{:?}", s.crashes());
}
