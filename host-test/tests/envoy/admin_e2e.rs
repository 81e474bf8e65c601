//! The tenants table kept in etcd (`budget_store.tenants`) and changed live with
//! `holysheep-admin`, in real Envoy: two nodes and a real etcd. A key added, rotated and
//! revoked, a budget changed and a tenant removed are in force on both nodes within 2 s
//! with no reload, a request admitted before a change completes, every change is in
//! `admin audit`; a malformed record and an etcd outage leave the last good table serving.

use host_test::client::{request, Resp};
use host_test::envoy::{Envoy, Options};
use host_test::etcd::Etcd;
use host_test::mock::Running;
use host_test::stack::{poll_until, prompt, PATH};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const OPERATOR_KEY: &str = "sk-operator-admin-51c2";

/// gpt-4.1 at $10 / $30 per million tokens; the tenants table in etcd, read every 200 ms;
/// two nodes share the store.
const CONFIG: &str = r#"{"models":{"gpt-4.1":{"usd_per_mtok_input":10,"usd_per_mtok_output":30}},
    "budget_store":{"cluster":"etcd","flush_ms":50,"timeout_ms":500,"replicas":2,"tenants":true,"tenants_poll_ms":200}}"#;

fn envoy(mock: &Running, etcd: &Etcd) -> Envoy {
    let mut opts = Options::new(CONFIG, mock.addr);
    opts.api_key = Some(OPERATOR_KEY.into());
    opts.extra_clusters = etcd.cluster();
    Envoy::start(&opts).expect("envoy starts")
}

/// The command line, built once for the test run.
fn admin_bin() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = host_test::envoy::workspace_root();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let built = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "holysheep-admin"])
            .current_dir(&root)
            .status()
            .expect("cargo runs");
        assert!(built.success(), "holysheep-admin builds");
        let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
        target.join("debug/holysheep-admin")
    })
}

/// Runs `holysheep-admin` against `etcd` as the operator `ops`: its output, or its error.
fn admin(etcd: &Etcd, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(admin_bin())
        .args(["--etcd", &format!("http://{}", etcd.addr), "--operator", "ops"])
        .args(args)
        .output()
        .expect("holysheep-admin runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_owned();
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(text(&out.stderr))
    }
}

/// A new key's token (the first line `key add` or `key rotate` prints).
fn token(printed: &str) -> String {
    printed.lines().next().unwrap_or_default().to_owned()
}

/// The digest of a token, as `key rotate` and `key revoke` name it.
fn digest(token: &str) -> String {
    host_test::stack::key_digest(token)[..12].to_owned()
}

fn chat(envoy: &Envoy, token: &str, text: &str) -> Resp {
    let auth = format!("Bearer {token}");
    request(envoy.edge, "POST", PATH, &[("authorization", &auth)], prompt(text).as_bytes()).expect("an answer")
}

/// Waits until every node answers `token` with `status`: how long that took.
fn in_force(nodes: &[&Envoy], token: &str, status: u16, what: &str) -> Duration {
    let start = Instant::now();
    let mut n = 0;
    poll_until(
        || {
            n += 1;
            nodes.iter().all(|e| chat(e, token, &format!("{what} {n}")).status == status)
        },
        &format!("{what}: never {status} on every node"),
    );
    let took = start.elapsed();
    eprintln!("admin_e2e: {what}: {status} on every node after {took:?}");
    took
}

#[test]
fn keys_budgets_and_tenants_changed_with_the_admin_command_hold_on_both_nodes_within_two_seconds() {
    let etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let (a, b) = (envoy(&mock, &etcd), envoy(&mock, &etcd));
    let nodes = [&a, &b];
    // An empty table never opens the edge.
    assert_eq!(chat(&a, "hs-anything", "before any tenant").status, 401);

    let first = token(
        &admin(&etcd, &["tenant", "add", "acme", "--usd-per-day", "5", "--reason", "onboarding"]).expect("added"),
    );
    assert!(first.starts_with("hs-"), "{first}");
    let took = in_force(&nodes, &first, 200, "a new tenant's key");
    assert!(took <= Duration::from_secs(2), "a tenant added took {took:?} to hold on both nodes");
    assert_eq!(mock.mock.last_authorization().as_deref(), Some(format!("Bearer {OPERATOR_KEY}").as_str()));

    let second = token(&admin(&etcd, &["key", "add", "acme", "--reason", "second key"]).expect("a key"));
    let took = in_force(&nodes, &second, 200, "a second key");
    assert!(took <= Duration::from_secs(2), "a key added took {took:?}");

    let third =
        token(&admin(&etcd, &["key", "rotate", "acme", &digest(&first), "--reason", "rotation"]).expect("rotated"));
    let took = in_force(&nodes, &third, 200, "the rotated key").max(in_force(&nodes, &first, 401, "the old key"));
    assert!(took <= Duration::from_secs(2), "a rotation took {took:?}");

    // Answers each node remembers for the key's exact request bytes (HITs sent again).
    for node in nodes {
        let answers: Vec<String> = (0..3).map(|_| chat(node, &second, "remembered").cache().to_owned()).collect();
        assert!(answers[1..].iter().all(|c| c == "HIT"), "{answers:?}");
    }
    admin(&etcd, &["key", "revoke", "acme", &digest(&second), "--reason", "leaked"]).expect("revoked");
    let revoked = Instant::now();
    in_force(&nodes, &second, 401, "the revoked key");
    // Every worker of both nodes (each takes the table on its next tick) refuses the key,
    // for the request bytes it remembered too.
    let refused = || nodes.iter().all(|n| (0..6).all(|_| chat(n, &second, "remembered").status == 401));
    poll_until(refused, "a remembered request of the revoked key was still answered");
    let took = revoked.elapsed();
    assert!(took <= Duration::from_secs(2), "a revocation took {took:?} to hold on every worker");
    assert_eq!(chat(&a, &third, "the other key still works").status, 200);
    let last = admin(&etcd, &["key", "revoke", "acme", &digest(&third), "--reason", "x"]).expect_err("the last key");
    assert!(last.contains("between 1 and 16"), "a tenant keeps a key: {last}");

    // A request admitted before a change completes.
    mock.mock.set_latency_ms(1_500);
    let slow = {
        let (edge, auth) = (a.edge, format!("Bearer {third}"));
        std::thread::spawn(move || {
            request(edge, "POST", PATH, &[("authorization", &auth)], prompt("admitted before").as_bytes())
        })
    };
    poll_until(|| a.stat("http.edge.downstream_rq_active") >= 1, "the slow request never arrived");
    // A budget too small for any call: refused on both nodes, while the slow call goes on.
    admin(&etcd, &["tenant", "set", "acme", "--usd-per-day", "0.000001", "--reason", "budget cut"]).expect("set");
    mock.mock.set_latency_ms(0);
    let took = in_force(&nodes, &third, 429, "a budget cut");
    assert!(took <= Duration::from_secs(2), "a budget change took {took:?}");
    assert_eq!(slow.join().expect("thread").expect("an answer").status, 200, "admitted before the change");

    admin(&etcd, &["tenant", "remove", "acme", "--reason", "offboarding"]).expect("removed");
    let took = in_force(&nodes, &third, 401, "a removed tenant");
    assert!(took <= Duration::from_secs(2), "a removal took {took:?}");

    // Every change, by whom and why, in order; and in each node's log.
    let audit: Vec<Value> = admin(&etcd, &["audit"])
        .expect("audit")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let actions: Vec<(&str, &str, &str)> = audit
        .iter()
        .map(|r| (r["action"].as_str().unwrap_or(""), r["by"].as_str().unwrap_or(""), r["why"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        actions,
        [
            ("tenant add", "ops", "onboarding"),
            ("key add", "ops", "second key"),
            ("key rotate", "ops", "rotation"),
            ("key revoke", "ops", "leaked"),
            ("tenant set", "ops", "budget cut"),
            ("tenant remove", "ops", "offboarding"),
        ]
    );
    let trail = admin(&etcd, &["audit"]).unwrap_or_default();
    assert!([&first, &second, &third].iter().all(|t| !trail.contains(t.as_str())), "tokens are never stored");
    poll_until(|| b.log().contains("tenant \"acme\" removed"), "the removal never reached the log");
    assert!(b.log().contains("tenant \"acme\" changed in the spend store's table by ops"), "{}", b.log());
    assert!(a.crashes().is_empty() && b.crashes().is_empty());
}

#[test]
fn a_malformed_record_and_an_etcd_outage_leave_the_last_good_table_serving() {
    let mut etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let a = envoy(&mock, &etcd);
    let key = token(&admin(&etcd, &["tenant", "add", "acme", "--reason", "onboarding"]).expect("added"));
    in_force(&[&a], &key, 200, "a new key");

    let shown = admin(&etcd, &["tenant", "show", "acme"]).expect("shown");
    assert!(!shown.contains(&key) && shown.contains(&host_test::stack::key_digest(&key)), "only the digest: {shown}");
    // The command line refuses a name whose counters would be another tenant's.
    let clash = admin(&etcd, &["tenant", "add", "Acme", "--reason", "x"]).expect_err("a clash");
    assert!(clash.contains("would be"), "{clash}");

    // A record the configuration refuses: logged and counted by name, the last good stays.
    assert!(etcd.put("holysheep/tenants/acme", r#"{"tenant":{"usd_per_day":"five"}}"#));
    assert!(etcd.put("holysheep/tenants/bad.name", r#"{"tenant":{}}"#));
    let refused = "wasmcustom.holysheep.tenants.tenant_records_refused";
    poll_until(|| a.counted(refused) == 2, "the malformed records were never counted");
    assert!(a.log().contains(r#"record of tenant "acme" is refused"#), "{}", a.log());
    assert!(a.log().contains("tenants.acme.usd_per_day: must be a number"), "{}", a.log());
    assert_eq!(chat(&a, &key, "after a malformed record").status, 200, "the last good record serves");
    // Read again and again: logged and counted once.
    let reads = a.stat("cluster.etcd.upstream_rq_completed");
    poll_until(|| a.stat("cluster.etcd.upstream_rq_completed") >= reads + 3, "the table was not read again");
    assert_eq!(a.counted(refused), 2);
    assert_eq!(a.log().matches(r#"record of tenant "acme" is refused"#).count(), 1);
    // The command line refuses a field a node would.
    assert!(admin(&etcd, &["tenant", "set", "acme", "--usd-per-day", "five", "--reason", "x"]).is_err());

    // etcd goes away: the table stays in force.
    etcd.stop();
    poll_until(|| a.counted("cluster.etcd.upstream_cx_connect_fail") >= 2, "etcd was never missed");
    assert_eq!(chat(&a, &key, "while etcd is away").status, 200);
    assert_eq!(chat(&a, "hs-unknown", "a stranger while etcd is away").status, 401);
    assert!(a.crashes().is_empty());
}
