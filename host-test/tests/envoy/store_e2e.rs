//! Spend kept in a real etcd (Debian's 3.4) in real Envoy: a tenant's budget holds across a
//! `kill -9` and a restart of Envoy, and across a restart during an etcd outage; a store
//! that does not answer is logged once while the node admits one call's worst case, and a
//! store cluster Envoy does not know refuses every budgeted call; two workers whose writes
//! overlap against a slow etcd count every call once; two Envoys that see each other write a
//! tenant's spend each admit their share.

use host_test::client::{request, Resp};
use host_test::envoy::{static_cluster, Envoy, Options};
use host_test::etcd::Etcd;
use host_test::mock::Running;
use host_test::stack::key_digest;
use host_test::stack::{burst_at, poll_until, prompt, PATH};

const OPERATOR_KEY: &str = "sk-operator-6d5c4b3a21";
const BATCH: &str = "hs-batch-store-8e7f6a5b4c";

/// gpt-4.1 at $10 / $30 per million tokens; `batch` with `budget_micro` a day; the spend
/// store written every 50 ms.
fn config(budget_micro: u64) -> String {
    format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
            "budget_store":{{"cluster":"etcd","flush_ms":50,"timeout_ms":500}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}}}}}}"#,
        key_digest(BATCH),
        budget_micro as f64 / 1e6
    )
}

fn envoy(config: &str, mock: &Running, clusters: String) -> Envoy {
    let mut opts = Options::new(config, mock.addr);
    opts.api_key = Some(OPERATOR_KEY.into());
    opts.extra_clusters = clusters;
    Envoy::start(&opts).expect("envoy starts")
}

fn chat(envoy: &Envoy, text: &str) -> Resp {
    let body = prompt(text).replacen('{', r#"{"max_tokens":20,"#, 1);
    let auth = format!("Bearer {BATCH}");
    request(envoy.edge, "POST", PATH, &[("authorization", &auth)], body.as_bytes()).expect("answer")
}

fn cost(r: &Resp) -> u64 {
    let u = &r.json()["usage"];
    u["prompt_tokens"].as_u64().unwrap_or(0) * 10 + u["completion_tokens"].as_u64().unwrap_or(0) * 30
}

/// The day's spend etcd holds for `batch`.
fn stored_day(etcd: &Etcd) -> u64 {
    let value = etcd.get("holysheep/budget/batch").unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&value).ok().and_then(|v| v["day_micro"].as_u64()).unwrap_or(0)
}

#[test]
fn a_tenants_spend_survives_a_kill_and_a_restart_of_envoy() {
    let etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    // A call's worst case: every body byte a token and max_tokens, at $30 per million.
    let worst = (prompt("spent before the kill 00").replacen('{', r#"{"max_tokens":20,"#, 1).len() as u64 + 20) * 30;
    let budget = 3 * worst;
    let mut first = envoy(&config(budget), &mock, etcd.cluster());
    // Calls one at a time until what is settled leaves no room for another worst case.
    let mut spent = 0;
    for i in 0.. {
        let r = chat(&first, &format!("spent before the kill {i:02}"));
        if r.status != 200 {
            assert_eq!(
                (r.status, r.json()["error"]["code"].as_str()),
                (429, Some("insufficient_quota")),
                "{}",
                r.text()
            );
            break;
        }
        spent += cost(&r);
    }
    assert!(spent + worst > budget && spent > 0, "{spent} of {budget}");
    // Written behind within a round: then the Envoy dies without a word.
    poll_until(|| stored_day(&etcd) == spent, "the spend never reached etcd");
    first.kill();
    let calls = mock.mock.calls();

    // A new Envoy, with nothing in memory, reads the tenant's spend before its first call.
    let second = envoy(&config(budget), &mock, etcd.cluster());
    let r = chat(&second, "after the restart");
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (429, Some("insufficient_quota")), "{}", r.text());
    assert_eq!(mock.mock.calls(), calls, "nothing was spent past the budget");
    assert_eq!(stored_day(&etcd), spent);
    assert!(second.crashes().is_empty(), "{:?}", second.crashes());
}

/// A cluster `etcd` at a port nobody listens on.
fn dead_etcd(port: u16) -> String {
    static_cluster("etcd", port, "0.2s")
}

#[test]
fn a_store_that_does_not_answer_is_logged_once_and_the_node_admits_one_call() {
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let dead = host_test::ports::free(1).expect("port")[0];
    let envoy = envoy(&config(1_000_000), &mock, dead_etcd(dead));
    // Nothing is known of what the tenant spent: one call's worst case, then a retryable
    // 503 until the store answers.
    let answers: Vec<Resp> = (0..5).map(|i| chat(&envoy, &format!("while etcd is away {i}"))).collect();
    assert_eq!(answers[0].status, 200, "one call: {}", answers[0].text());
    for r in &answers[1..] {
        let v = r.json();
        assert_eq!((r.status, v["error"]["code"].as_str()), (503, Some("budget_store_unavailable")), "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("5"));
    }
    assert_eq!(mock.mock.calls(), 1);
    let said = "the spend store (budget_store) does not answer";
    poll_until(|| envoy.log().contains(said), "the store's silence was never logged");
    // Once more asked after the line was written (a round of writes reads the key again
    // every five seconds), the store is still silent: still one line.
    let tried = || envoy.counted("cluster.etcd.upstream_cx_connect_fail");
    let logged_at = tried();
    assert!(logged_at >= 1, "the node asked the store");
    poll_until(|| tried() > logged_at, "the node never asked the store again");
    let again = chat(&envoy, "while etcd is still away");
    assert_eq!(again.status, 503, "{}", again.text());
    assert_eq!(envoy.log().matches(said).count(), 1, "logged once, not per request or per read");
    assert!(envoy.crashes().is_empty(), "{:?}", envoy.crashes());
}

#[test]
fn a_restart_during_an_etcd_outage_admits_no_fresh_day() {
    let mut etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let worst = (prompt("spent before the outage 00").replacen('{', r#"{"max_tokens":20,"#, 1).len() as u64 + 20) * 30;
    let budget = 3 * worst;
    let mut first = envoy(&config(budget), &mock, etcd.cluster());
    let mut spent = 0;
    for i in 0.. {
        let r = chat(&first, &format!("spent before the outage {i:02}"));
        if r.status != 200 {
            break;
        }
        spent += cost(&r);
    }
    poll_until(|| stored_day(&etcd) == spent, "the spend never reached etcd");
    first.kill();
    let port = etcd.addr.port();
    etcd.stop();
    let calls = mock.mock.calls();
    // The tenant spent its day; Envoy restarts while etcd is down.
    let second = envoy(&config(budget), &mock, dead_etcd(port));
    let answers: Vec<Resp> = (0..10).map(|i| chat(&second, &format!("after the restart {i}"))).collect();
    let served = answers.iter().filter(|r| r.status == 200).count();
    assert!(served <= 1, "at most one call's worst case, not a fresh day: {served} of 10 served");
    assert!(mock.mock.calls() <= calls + 1);
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(r.json()["error"]["code"].as_str(), Some("budget_store_unavailable"), "{}", r.text());
    }
    assert!(second.crashes().is_empty(), "{:?}", second.crashes());
}

#[test]
fn a_store_cluster_envoy_does_not_know_refuses_every_budgeted_call() {
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    let typo = config(1_000_000).replace(r#""cluster":"etcd""#, r#""cluster":"etdc""#);
    let envoy = envoy(&typo, &mock, String::new());
    for i in 0..3 {
        let r = chat(&envoy, &format!("a typo {i}"));
        let v = r.json();
        assert_eq!((r.status, v["error"]["code"].as_str()), (500, Some("edge_misconfigured")), "{}", r.text());
        assert!(v["error"]["message"].as_str().unwrap_or("").contains("budget_store.cluster 'etdc'"));
    }
    assert_eq!(mock.mock.calls(), 0);
    let said = "budget_store.cluster 'etdc' is no cluster this Envoy knows";
    assert_eq!(envoy.log().matches(said).count(), 1, "logged once: {}", envoy.log());
    assert!(envoy.crashes().is_empty(), "{:?}", envoy.crashes());
}

#[test]
fn over_three_nodes_a_budget_survives_a_rolling_restart_with_every_node_killed() {
    use host_test::fleet::{round_robin, spread, Fleet};
    let etcd = Etcd::start().expect("etcd starts");
    let bodies = |tag: &str| -> Vec<String> {
        (0..60).map(|i| prompt(&format!("{tag} {i:02}")).replacen('{', r#"{"max_tokens":20,"#, 1)).collect()
    };
    let (before, after) = (bodies("before the deploy"), bodies("after the deploy!"));
    // What the mock bills one of these (its prompt at four characters a token, plus four;
    // its answer's words), and a call's worst case.
    let call = (("before the deploy 00".len() as u64 + 4).div_ceil(4)) * 10 + (5 + 4) * 30;
    let worst = (before[0].len() as u64 + 20) * 30;
    // Ninety calls' worth: the sixty before the deploy fit, and the budget binds after.
    let budget = 90 * call;
    // `probe`: the key the fleet's start-up probes of its ring carry (no budget).
    let config = format!(
        r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":10,"usd_per_mtok_output":30}}}},
            "rate_limit":{{"max_wait_ms":20000}},
            "budget_store":{{"cluster":"etcd","flush_ms":50,"timeout_ms":500}},
            "tenants":{{"batch":{{"keys_sha256":["{}"],"usd_per_day":{}}},"probe":{{"keys_sha256":["{}"]}}}}}}"#,
        key_digest(BATCH),
        budget as f64 / 1e6,
        key_digest("probe")
    );
    let mut fleet = Fleet::with_clusters(0, 3, &config, 50, Some(OPERATOR_KEY), &etcd.cluster());
    let auth = format!("Bearer {BATCH}");
    let first = spread(round_robin(&fleet.publics(), before), &auth);
    assert!(first.iter().all(|r| r.status == 200), "{:?}", first.iter().map(|r| r.status).collect::<Vec<_>>());
    let spent_before: u64 = first.iter().map(cost).sum();
    assert_eq!(spent_before, 60 * call);
    poll_until(|| stored_day(&etcd) == spent_before, "the spend never reached etcd");
    // A rolling deploy done the hard way: every node killed in turn (the tenant's owner
    // among them), then started again with nothing in memory.
    for i in 0..3 {
        fleet.kill(i);
        fleet.restart(i, 3);
    }
    let second = spread(round_robin(&fleet.publics(), after), &auth);
    let served: Vec<&Resp> = second.iter().filter(|r| r.status == 200).collect();
    for r in second.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (429, Some("insufficient_quota")), "{}", r.text());
    }
    let billed: u64 = fleet
        .mock
        .mock
        .billed_for("gpt-4.1")
        .iter()
        .map(|u| u["prompt_tokens"].as_u64().unwrap_or(0) * 10 + u["completion_tokens"].as_u64().unwrap_or(0) * 30)
        .sum();
    assert_eq!(
        billed,
        spent_before + served.iter().map(|r| cost(r)).sum::<u64>(),
        "HolySheep billed what was answered"
    );
    assert!(billed <= budget, "HolySheep billed {billed} of a budget of {budget}");
    assert!(served.len() < 60, "the budget bound after the deploy: {} of 60 served", served.len());
    assert!(billed + worst > budget, "refused only when no worst case fitted: {billed} of {budget}");
    assert!(fleet.crashes().is_empty(), "{:?}", fleet.crashes());
}

/// A listener `etcd_slow` on `port` that holds every request `delay_ms` (Envoy's own fault
/// filter) before it goes on to the cluster `etcd_real`.
fn slow_listener(port: u16, delay_ms: u64) -> String {
    let delay_s = delay_ms as f64 / 1000.0;
    format!(
        r#"  - name: etcd_slow
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: etcd_slow
          route_config:
            virtual_hosts:
            - name: etcd
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: etcd_real, timeout: 10s}}
          http_filters:
          - name: envoy.filters.http.fault
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
              delay:
                fixed_delay: {delay_s}s
                percentage: {{numerator: 100, denominator: HUNDRED}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}

#[test]
fn two_workers_whose_writes_overlap_against_a_slow_etcd_count_every_call_once() {
    let etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 0).expect("mock");
    // etcd answers each request 300 ms late, five rounds of writes (`flush_ms`: 60) later;
    // each worker ticks every 25 ms (a quarter of `lock.lease_ms`), so that rounds fall to
    // both workers while a write is out.
    let slow = host_test::ports::free(1).expect("port")[0];
    let budget = 1_000_000;
    let config = config(budget)
        .replace(r#""flush_ms":50,"timeout_ms":500"#, r#""flush_ms":60,"timeout_ms":2000"#)
        .replacen('{', r#"{"lock":{"lease_ms":100},"#, 1);
    let mut opts = Options::new(&config, mock.addr);
    opts.api_key = Some(OPERATOR_KEY.into());
    opts.extra_listeners = slow_listener(slow, 300);
    opts.extra_clusters = static_cluster("etcd", slow, "1s") + &static_cluster("etcd_real", etcd.addr.port(), "1s");
    let envoy = Envoy::start(&opts).expect("envoy starts");
    let auth = format!("Bearer {BATCH}");
    let mut spent = 0;
    // Waves of four concurrent calls over both workers, 100 ms apart: each settles while
    // the writes of the waves before it are out, after rounds that found nothing new.
    for wave in 0..12 {
        let bodies: Vec<String> =
            (0..4).map(|i| prompt(&format!("wave {wave} call {i}")).replacen('{', r#"{"max_tokens":20,"#, 1)).collect();
        let answers = burst_at(envoy.edge, bodies, &auth);
        assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(Resp::text).collect::<Vec<_>>());
        spent += answers.iter().map(cost).sum::<u64>();
        // The traffic's shape, not a wait for an event.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(mock.mock.calls(), 48);
    poll_until(|| stored_day(&etcd) == spent, "etcd never held what the calls cost");
    assert!(envoy.stat("http.etcd_slow.fault.delays_injected") >= 2, "the writes were slow");
    // One more call moves etcd and the node's own count by exactly its cost: nothing was
    // written twice or taken out twice.
    let last = chat(&envoy, "after the waves");
    assert_eq!(last.status, 200, "{}", last.text());
    spent += cost(&last);
    poll_until(|| stored_day(&etcd) == spent, "etcd never held the last call's cost");
    let left = "wasmcustom.holysheep.tenant.batch.budget_day_left_microusd";
    poll_until(|| envoy.stat(left) == budget - spent, "the node's own count differs from etcd's");
    assert!(envoy.crashes().is_empty(), "{:?}", envoy.crashes());
}

/// Two independent Envoys on one etcd (no fleet) take ten concurrent calls each, with a
/// budget of six and a half worst cases (one cheap call each already spent) and HolySheep
/// slow enough that none of the ten settles first: how many each lets through. With
/// `replicas: 1`, the burst waits until each Envoy has seen the other write the tenant's
/// spend (each logs it). `alone`: one Envoy only, the second never started.
fn replicas_in_flight(replicas: u32, alone: bool) -> (usize, usize) {
    let etcd = Etcd::start().expect("etcd starts");
    let mock = Running::start(Some(OPERATOR_KEY), 3_000).expect("mock");
    let body = |envoy: &str, i: usize| {
        prompt(&format!("replica {envoy} call {i:02}")).replacen('{', r#"{"max_tokens":20,"#, 1)
    };
    let worst = (body("a", 0).len() as u64 + 20) * 30;
    // A held call is told so at once (`max_wait_ms`: 0), not held for room.
    let config = config(6 * worst + worst / 2)
        .replacen('{', r#"{"rate_limit":{"max_wait_ms":0},"#, 1)
        .replace(r#""timeout_ms":500"#, &format!(r#""timeout_ms":500,"replicas":{replicas}"#));
    let a = envoy(&config, &mock, etcd.cluster());
    if alone {
        assert_eq!(chat(&a, "first on a").status, 200);
        assert_eq!(chat(&a, "second on a").status, 200);
        let answers = burst_at(a.edge, (0..10).map(|i| body("a", i)).collect(), &format!("Bearer {BATCH}"));
        assert!(answers.iter().all(|r| r.status == 200 || r.status == 429));
        assert!(a.crashes().is_empty());
        return (answers.iter().filter(|r| r.status == 200).count(), 0);
    }
    let b = envoy(&config, &mock, etcd.cluster());
    // Each has read the tenant's key (one call's worth, settled and written).
    for (name, e) in [("a", &a), ("b", &b)] {
        assert_eq!(chat(e, &format!("first on {name}")).status, 200);
    }
    if replicas == 1 {
        // Each learns of the other from the store: by a refused write, by the read a
        // record with nothing to write gets every five seconds, or by the write a keeper
        // among several makes as often while it admits.
        let logged = "tenant batch's spend is written by 2 processes (other Envoys share the store: set \
                      budget_store.replicas to their number)";
        poll_until(|| a.log().contains(logged) && b.log().contains(logged), "the two never saw each other write");
        let keepers = "wasmcustom.holysheep.tenant.batch.budget_keepers";
        for e in [&a, &b] {
            assert_eq!(e.log().matches(logged).count(), 1, "logged once per process");
            poll_until(|| e.stat(keepers) == 2, "the gauge never said so");
        }
    }
    // Shown when the test fails.
    let keepers = |e: &Envoy| e.stat("wasmcustom.holysheep.tenant.batch.budget_keepers");
    eprintln!(
        "before the bursts: keepers {} and {}, etcd {:?}",
        keepers(&a),
        keepers(&b),
        etcd.get("holysheep/budget/batch")
    );
    let auth = format!("Bearer {BATCH}");
    let bursts: Vec<_> = [("a", a.edge), ("b", b.edge)]
        .into_iter()
        .map(|(name, addr)| {
            let (bodies, auth) = ((0..10).map(|i| body(name, i)).collect::<Vec<_>>(), auth.clone());
            std::thread::spawn(move || burst_at(addr, bodies, &auth))
        })
        .collect();
    let served: Vec<usize> = bursts
        .into_iter()
        .map(|t| {
            let answers = t.join().expect("burst");
            for r in answers.iter().filter(|r| r.status != 200) {
                eprintln!("refused: {}", r.text());
                assert_eq!(r.status, 429, "{}", r.text());
            }
            answers.iter().filter(|r| r.status == 200).count()
        })
        .collect();
    assert!(a.crashes().is_empty() && b.crashes().is_empty());
    (served[0], served[1])
}

#[test]
fn replicas_sharing_etcd_without_a_fleet_each_hold_their_share_in_flight() {
    // With `replicas: 2` each holds half of what etcd left from the start: the worst
    // cases in flight over both stay within the budget (alone, each would take 6).
    assert_eq!(replicas_in_flight(2, false), (3, 3), "with shares");
}

#[test]
fn one_envoy_alone_on_the_store_holds_what_the_budget_left_in_flight() {
    // What the shares are measured against: one Envoy alone, with the same budget and the
    // same two cheap calls spent before, lets 6 of the 10 through.
    assert_eq!(replicas_in_flight(1, true), (6, 0), "alone");
}

#[test]
fn two_envoys_that_see_each_other_write_a_tenants_spend_each_admit_their_share() {
    // Without `replicas`, as two owners of a tenant while a fleet's ring changes: once
    // each has seen the other's writes, each holds half of what etcd left (before, each
    // could take what the budget left, as one alone does: 6 worst cases in flight for a
    // budget of 6.5).
    assert_eq!(replicas_in_flight(1, false), (3, 3), "each its share");
}
