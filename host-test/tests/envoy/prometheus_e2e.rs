//! A real Prometheus (Debian's `prometheus`) scraping a real Envoy with the plugin (or the
//! native module) and the stats tags `envoy/production.yaml` ships, with the scrape
//! configuration and rules `deploy/prometheus/` ships; its HTTP API must return the counts
//! the mock saw, load every rule, and answer every query of the Grafana dashboard.

use host_test::client::request;
use host_test::envoy::{workspace_root, Shell};
use host_test::stack::{key_digest, poll_until, prompt, prompt_for, Stack};
use serde_json::Value;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: PathGuard,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A directory removed when dropped.
struct PathGuard(std::path::PathBuf);

impl Drop for PathGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `deploy/prometheus/prometheus.yml` as shipped, scraping `admin` every second (and
/// evaluating the rules every second) instead of every 15 s at 127.0.0.1:9901.
fn start_prometheus(admin: SocketAddr) -> Prometheus {
    let deploy = workspace_root().join("deploy/prometheus");
    let dir = std::env::temp_dir().join(format!("holysheep-prometheus-{}-{}", std::process::id(), admin.port()));
    std::fs::create_dir_all(&dir).expect("dir");
    let shipped = std::fs::read_to_string(deploy.join("prometheus.yml")).expect("prometheus.yml");
    // The rules as shipped, evaluated every second.
    let rules = std::fs::read_to_string(deploy.join("holysheep.rules.yml")).expect("rules");
    let rules_copy = dir.join("holysheep.rules.yml");
    std::fs::write(&rules_copy, rules.replacen("  interval: 30s", "  interval: 1s", 1)).expect("rules copy");
    let config = shipped
        .replacen("targets: [\"127.0.0.1:9901\"]", &format!("targets: [\"{admin}\"]"), 1)
        .replacen("scrape_interval: 15s", "scrape_interval: 1s", 1)
        .replacen("evaluation_interval: 30s", "evaluation_interval: 1s", 1)
        .replacen("- holysheep.rules.yml", &format!("- {}", rules_copy.display()), 1);
    assert_eq!(config.matches("1s").count(), 2, "the shipped file changed: this test's substitutions must follow");
    std::fs::write(dir.join("prometheus.yml"), config).expect("config");
    let port = host_test::ports::free(1).expect("a port")[0];
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log"))
        .spawn()
        .expect("prometheus starts (Debian's prometheus package; envoy/setup.sh installs it)");
    let p = Prometheus { child, addr, _dir: PathGuard(dir) };
    poll_until(
        || request(addr, "GET", "/-/ready", &[], b"").is_ok_and(|r| r.status == 200),
        "prometheus never got ready",
    );
    p
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query's result (`data.result`), or the error Prometheus gave.
fn query(p: &Prometheus, q: &str) -> Result<Vec<Value>, String> {
    let r =
        request(p.addr, "GET", &format!("/api/v1/query?query={}", encode(q)), &[], b"").map_err(|e| e.to_string())?;
    let v = r.json();
    match v["status"].as_str() {
        Some("success") => Ok(v["data"]["result"].as_array().cloned().unwrap_or_default()),
        _ => Err(format!("{q}: {}", r.text())),
    }
}

/// The single value of a query (`None` while it has none).
fn scalar(p: &Prometheus, q: &str) -> Option<f64> {
    let result = query(p, q).ok()?;
    let [one] = &result[..] else { return None };
    one["value"][1].as_str()?.parse().ok()
}

#[test]
fn prometheus_sees_the_hits_calls_and_dollars_the_mock_saw() {
    prometheus_sees_what_the_mock_saw(Shell::Wasm);
}

/// The native module counts under the plugin's names: the same series, rules and dashboard.
#[test]
fn prometheus_sees_the_same_of_the_native_module() {
    prometheus_sees_what_the_mock_saw(Shell::Native);
}

fn prometheus_sees_what_the_mock_saw(shell: Shell) {
    // Every request is the tenant search's, which has a day budget of $5.
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2.0,"usd_per_mtok_output":8.0}},
                       "deepseek-v3":{{"requests_per_minute":1,"burst":1,"usd_per_mtok_input":1.0,"usd_per_mtok_output":1.0}}}},
            "tenants":{{"search":{{"keys_sha256":["{}"],"usd_per_day":5}}}}}}"#,
        key_digest("sk-prometheus")
    );
    let s = Stack::start_tuned(&config, 0, |o| o.shell = shell, None);
    let auth = [("authorization", "Bearer sk-prometheus")];
    let body = prompt("counted by prometheus");
    let miss = s.chat(&body, &auth);
    for _ in 0..4 {
        assert_eq!(s.chat(&body, &auth).cache(), "HIT");
    }
    let deepseek = s.chat(&prompt_for("deepseek-v3", "one"), &auth);
    assert_eq!(deepseek.status, 200);
    assert_eq!(s.chat(&prompt_for("deepseek-v3", "two"), &auth).status, 429);
    let tokens = |r: &host_test::client::Resp| {
        let usage = &r.json()["usage"];
        (usage["prompt_tokens"].as_u64().unwrap_or(0), usage["completion_tokens"].as_u64().unwrap_or(0))
    };
    let (input, output) = tokens(&miss);
    let (deepseek_in, deepseek_out) = tokens(&deepseek);
    let calls = s.calls();
    assert_eq!(calls, 2);

    let p = start_prometheus(s.envoy.admin);
    poll_until(
        || scalar(&p, r#"sum(holysheep_requests{gen_ai_request_model="gpt-4.1"})"#) == Some(5.0),
        "prometheus never saw the five gpt-4.1 requests",
    );
    assert_eq!(scalar(&p, r#"holysheep_requests{gen_ai_request_model="gpt-4.1", holysheep_cache="hit"}"#), Some(4.0));
    assert_eq!(
        scalar(&p, r#"holysheep_requests{gen_ai_request_model="deepseek-v3", holysheep_cache="miss"}"#),
        Some(2.0),
        "the 429 is a miss"
    );
    assert_eq!(scalar(&p, "sum(holysheep_upstream_calls)"), Some(calls as f64), "the calls the mock saw");
    assert_eq!(scalar(&p, r#"holysheep_rate_limited{gen_ai_request_model="deepseek-v3"}"#), Some(1.0));
    let hit_ratio = r#"sum(holysheep_requests{holysheep_cache=~"hit|coalesced"}) / sum(holysheep_requests)"#;
    assert_eq!(scalar(&p, hit_ratio), Some(4.0 / 7.0));
    let spent = (input * 2 + output * 8) as f64;
    assert_eq!(
        scalar(&p, r#"holysheep_cost_spent_microusd{gen_ai_request_model="gpt-4.1"}"#),
        Some(spent),
        "dollars, in millionths"
    );
    assert_eq!(
        scalar(&p, r#"holysheep_cost_saved_microusd{gen_ai_request_model="gpt-4.1"}"#),
        Some(spent * 4.0),
        "four HITs saved it"
    );
    // Every call was the budgeted tenant's, each of known cost: its budget was charged that.
    assert_eq!(
        scalar(&p, r#"holysheep_budget_charged_microusd{gen_ai_request_model="gpt-4.1"}"#),
        Some(spent),
        "charged to the budget"
    );
    // The tenant's copies and its budget gauge: labelled by tenant, never counted twice.
    let tenant_hits = r#"holysheep_tenant_requests{holysheep_tenant="search", holysheep_cache="hit"}"#;
    assert_eq!(scalar(&p, tenant_hits), Some(4.0));
    assert_eq!(scalar(&p, "sum(holysheep_requests)"), Some(7.0), "the tenant's copies are not in the sum");
    let left = 5_000_000.0 - spent - (deepseek_in + deepseek_out) as f64;
    let gauge = r#"holysheep_tenant_budget_day_left_microusd{holysheep_tenant="search"}"#;
    assert_eq!(scalar(&p, gauge), Some(left), "the day's budget less what both calls cost");
    if shell == Shell::Wasm {
        assert!(
            scalar(&p, "sum(envoy_wasm_envoy_wasm_runtime_v8_created)").is_some_and(|n| n >= 1.0),
            "the reload alert's series"
        );
    }

    // Every rule loads and evaluates without error.
    poll_until(
        || {
            let r = request(p.addr, "GET", "/api/v1/rules", &[], b"").map(|r| r.json()).unwrap_or_default();
            let rules: Vec<&Value> = r["data"]["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().into_iter().flatten())
                .collect();
            rules.len() == 14 && rules.iter().all(|r| r["health"] == "ok")
        },
        "the shipped rules never all evaluated",
    );
    // Every query of the dashboard is one Prometheus accepts.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace_root().join("deploy/grafana/holysheep-edge.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    assert_eq!(exprs.len(), 12);
    for e in exprs {
        query(&p, e).unwrap_or_else(|err| panic!("the dashboard's query is refused: {err}"));
    }
    assert!(s.crashes().is_empty());
}

#[test]
fn a_forward_nodes_series_are_labelled_apart_from_an_owners() {
    // The stats tags never take a forward node's `edge.` prefix (or a tenant's name) for a
    // model: its series keep names of their own, so no total counts a request twice.
    let config = format!(
        r#"{{"role":"forward","models":{{"gpt-4.1":{{}}}},"tenants":{{"search":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest("sk-forward")
    );
    let s = Stack::start(&config, 0);
    let text = request(s.envoy.admin, "GET", "/stats/prometheus", &[], b"").expect("stats").text();
    let series: Vec<&str> = text.lines().filter(|l| l.starts_with("holysheep")).collect();
    for want in [
        r#"holysheep_edge_requests{gen_ai_request_model="gpt-4.1",holysheep_cache="hit"} 0"#,
        r#"holysheep_edge_tenant_requests{holysheep_tenant="search",holysheep_cache="hit"} 0"#,
        r#"holysheep_edge_tenants_requests{holysheep_cache="hit"} 0"#,
    ] {
        assert!(series.contains(&want), "{want} in {series:#?}");
    }
    let misread = |l: &&&str| l.starts_with("holysheep_requests") || l.contains(r#"gen_ai_request_model="edge"#);
    assert_eq!(series.iter().filter(misread).count(), 0, "{series:#?}");
    assert!(s.crashes().is_empty());
}
