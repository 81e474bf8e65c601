//! Many edge nodes as one: three real Envoys (`--concurrency 2` each) on one machine, each
//! with a public listener (role `forward`) and an owner listener (role `owner`) on one
//! consistent-hash ring, in front of one mock HolySheep.

use host_test::client::{request, Conn, Resp};
use host_test::fleet::{content, round_robin, Fleet, FLEET_SAN, SECRET};
use host_test::mock::Fault;
use host_test::stack::streamed;
use host_test::stack::{count, prompt, prompt_for, PATH};
use std::net::SocketAddr;
use std::time::Duration;

/// Near copies off: these tests are about the owners (edge_e2e has the near copies).
const CONFIG: &str = r#"{"models":{"deepseek-v3":{"requests_per_minute":1,"burst":6}},"edge":{"max_age_seconds":0}}"#;

/// `curl` over TLS to `addr` (its server certificate not checked: the owner's checks of the
/// client are what is tried), presenting `cert` (`NAME.pem` and `NAME-key.pem` of the test
/// certificates) when given: the answer's status and body, or curl's exit code when there
/// was none (35, 55 or 56: the server ended the connection; 58 would be curl refusing the
/// certificate itself).
fn curl(
    addr: SocketAddr,
    path: &str,
    cert: Option<&str>,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(u16, String), i32> {
    let dir = host_test::fleet::certificates();
    let mut c = std::process::Command::new("curl");
    c.args(["-sk", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}", "--data-binary", "@-"]);
    if let Some(name) = cert {
        c.arg("--cert").arg(dir.join(format!("{name}.pem"))).arg("--key").arg(dir.join(format!("{name}-key.pem")));
    }
    for (n, v) in headers {
        c.args(["-H", &format!("{n}: {v}")]);
    }
    c.arg(format!("https://{addr}{path}"));
    let mut child = c.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().expect("curl");
    use std::io::Write;
    child.stdin.take().expect("stdin").write_all(body).expect("the body");
    let out = child.wait_with_output().expect("curl ends");
    let code = out.status.code().unwrap_or(-1);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    match text.rsplit_once('\n').map(|(b, s)| (b.to_owned(), s.trim().parse::<u16>())) {
        Some((body, Ok(status))) if code == 0 && status != 0 => Ok((status, body)),
        _ => Err(code),
    }
}

/// One request per (address, body) with the fleet tests' key.
fn spread(targets: Vec<(SocketAddr, String)>) -> Vec<Resp> {
    host_test::fleet::spread(targets, "Bearer sk-fleet")
}

fn peer_call(addr: SocketAddr, path: &str, secret: Option<&str>) -> Resp {
    let body = br#"{"take":{"model":"deepseek-v3","id":1,"estimate":1,"hold_ms":1}}"#;
    let headers: Vec<(&str, &str)> = secret.map(|s| vec![("x-holysheep-peer-secret", s)]).unwrap_or_default();
    request(addr, "POST", path, &headers, body).expect("answer")
}

#[test]
fn three_nodes_act_as_one_edge() {
    let fleet = Fleet::start(3, CONFIG, 300);
    let publics = fleet.publics();
    let probes = fleet.calls();

    // 300 identical requests over the three public listeners: one call, one answer.
    let body = prompt("one owner for the whole fleet");
    let answers = spread(round_robin(&publics, vec![body.clone(); 300]));
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
    assert_eq!(fleet.calls() - probes, 1, "one upstream call for the fleet");
    assert_eq!((count(&answers, "MISS"), count(&answers, "COALESCED")), (1, 299));
    assert!(answers.iter().all(|r| content(r) == content(&answers[0])), "the same answer everywhere");
    for public in &publics {
        let r =
            request(*public, "POST", PATH, &[("authorization", "Bearer sk-fleet")], body.as_bytes()).expect("answer");
        assert_eq!((r.status, r.cache(), content(&r)), (200, "HIT", content(&answers[0])), "a HIT on every node");
    }
    // A client's own x-holysheep-key does not route: each lands on the owner, a HIT.
    for bogus in ["0", "ffff", "evil", "1234567890", "owner-2", "x"] {
        let headers = [("authorization", "Bearer sk-fleet"), ("x-holysheep-key", bogus)];
        let r = request(publics[0], "POST", PATH, &headers, body.as_bytes()).expect("answer");
        assert_eq!(r.cache(), "HIT", "x-holysheep-key: {bogus}");
    }
    assert_eq!(fleet.calls() - probes, 1);

    // A stream crosses the forward hop live: the first event arrives while the mock holds
    // the rest.
    fleet.mock.mock.plan(vec![Fault { hold_after_events: Some(3), ..Fault::default() }]);
    let streamed = streamed(&prompt("stream across the fleet"));
    let mut conn = Conn::open(publics[1]).and_then(|c| c.read_timeout(Duration::from_secs(20))).expect("connect");
    conn.send_only("POST", PATH, &[("authorization", "Bearer sk-fleet")], streamed.as_bytes()).expect("send");
    let head = conn.read_until("\"role\":\"assistant\"").expect("the first event before the rest was sent");
    assert!(head.contains("x-holysheep-cache: MISS"), "{head}");
    fleet.mock.mock.release();
    conn.read_until("data: [DONE]").expect("the rest of the stream");

    // burst 6 on deepseek-v3: 30 distinct requests over the nodes admit 6 in total.
    let calls_before = fleet.calls();
    let bodies = (0..30).map(|i| prompt_for("deepseek-v3", &format!("limited {i}"))).collect();
    let limited = spread(round_robin(&publics, bodies));
    let admitted = limited.iter().filter(|r| r.status == 200).count();
    let refused = limited.iter().filter(|r| r.status == 429).count();
    assert_eq!((admitted, refused), (6, 24), "burst 6 holds fleet-wide");
    assert_eq!(fleet.calls() - calls_before, 6);
    assert_eq!(fleet.counted("wasmcustom.holysheep.deepseek-v3.fleet_local_share"), 0, "every model owner was reached");

    // Internal calls are 404 on a public listener, in any spelling.
    for path in ["/holysheep/peer/bucket", "//holysheep/./peer/bucket", "/%68olysheep/peer/bucket"] {
        let r = peer_call(publics[0], path, Some(SECRET));
        assert_eq!((r.status, r.json()["error"]["code"].as_str()), (404, Some("unknown_url")), "{path}");
    }

    // Over mutual TLS, an owner listener talks only to a client with a certificate of the
    // fleet's CA and SAN: none, another SAN, another CA or an expired one is refused in the
    // handshake, and nothing reaches HolySheep. A node's certificate is served without the secret.
    let owner = fleet.live().next().map(|n| n.owner).expect("a node");
    let calls = fleet.calls();
    let body = prompt("straight to an owner listener");
    for cert in [None, Some("stranger"), Some("rogue/node"), Some("expired")] {
        let r = curl(owner, PATH, cert, &[], body.as_bytes());
        assert!(matches!(r, Err(35 | 55 | 56)), "{cert:?}: not refused by the owner in the handshake: {r:?}");
    }
    assert_eq!(fleet.calls(), calls, "no call for a client without the fleet's certificate");
    let as_node = curl(owner, PATH, Some("node"), &[], body.as_bytes());
    assert_eq!(as_node.map(|(status, _)| status), Ok(200), "a node's certificate is a node's");
    assert_eq!(fleet.calls(), calls + 1);
    // Internal calls still need the secret, certificate or not.
    let peer = br#"{"take":{"model":"deepseek-v3","id":1,"estimate":1,"hold_ms":1}}"#;
    let unsigned = curl(owner, "/holysheep/peer/bucket", Some("node"), &[], peer);
    assert_eq!(unsigned.map(|(status, _)| status), Ok(403));
    let signed = curl(owner, "/holysheep/peer/bucket", Some("node"), &[("x-holysheep-peer-secret", SECRET)], peer);
    assert_eq!(signed.as_ref().map(|(status, _)| *status), Ok(200), "{signed:?}");
    // The forward and owner listeners' configurations spell one set of settings otherwise
    // (`role`, `fleet`): every hop's digest matched its owner's.
    assert_eq!(fleet.counted("wasmcustom.holysheep.fleet.config_mismatch"), 0);
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn a_plain_fleet_knows_its_nodes_by_the_secret() {
    let fleet = Fleet::plain(2, CONFIG, 0);
    let publics = fleet.publics();
    // Internal calls: refused without the secret on the owner listener.
    let owner = fleet.live().next().map(|n| n.owner).expect("a node");
    assert_eq!(peer_call(owner, "/holysheep/peer/bucket", None).status, 403);
    assert_eq!(peer_call(owner, "/holysheep/peer/bucket", Some("guess")).status, 403);
    let granted = peer_call(owner, "/holysheep/peer/bucket", Some(SECRET));
    assert_eq!(granted.status, 200, "the fleet's own call with its secret: {}", granted.text());
    assert!(granted.json()["admitted"].is_boolean());

    // A client that reaches an owner listener itself is refused (only the fleet's nodes,
    // whose requests carry the secret, are served there), and nothing reaches HolySheep;
    // the same request through either public listener is answered.
    let calls = fleet.calls();
    let body = prompt("straight to an owner listener");
    for secret in [None, Some("guess")] {
        let headers: Vec<(&str, &str)> = secret.map(|s| vec![("x-holysheep-peer-secret", s)]).unwrap_or_default();
        let direct = request(owner, "POST", PATH, &headers, body.as_bytes()).expect("answer");
        assert_eq!((direct.status, direct.error_code()), (403, "peer_required".to_owned()), "{}", direct.text());
        let models = request(owner, "GET", "/v1/models", &headers, b"").expect("answer");
        assert_eq!(models.status, 403, "{}", models.text());
    }
    assert_eq!(fleet.calls(), calls, "no call for a client on an owner listener");
    for (i, public) in publics.iter().enumerate() {
        let via = request(*public, "POST", PATH, &[], prompt(&format!("through public listener {i}")).as_bytes())
            .expect("answer");
        assert_eq!(via.status, 200, "{}", via.text());
    }
    assert_eq!(fleet.calls(), calls + 2);
    assert_eq!(fleet.stat("wasmcustom.holysheep.fleet.peer_refused"), 4);
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn a_forward_node_shares_only_answers_its_owner_keyed_alike() {
    // The owners scope requests by an auth layer's `x-tenant-id`; the public listeners'
    // configuration does not: two tenants' identical requests are one key there.
    let owners = r#"{"cache":{"tenant_header":"x-tenant-id"},"edge":{"max_age_seconds":0}}"#;
    let forward = r#"{"edge":{"max_age_seconds":0}}"#;
    let fleet = Fleet::disagreeing(2, owners, forward, 400);
    let mismatches = || fleet.stat("wasmcustom.holysheep.fleet.config_mismatch");
    let counted = mismatches();
    let public = fleet.publics()[0];
    let body = prompt("the same prompt from two tenants at once");
    let calls = fleet.calls();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let asks: Vec<_> = ["alpha", "beta"]
        .into_iter()
        .map(|tenant| {
            let (barrier, body) = (barrier.clone(), body.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(public).expect("connect");
                barrier.wait();
                conn.request("POST", PATH, &[("x-tenant-id", tenant)], body.as_bytes()).expect("answer")
            })
        })
        .collect();
    let answers: Vec<Resp> = asks.into_iter().map(|h| h.join().expect("client")).collect();
    // Each tenant gets its own owner's answer: one upstream call each, nothing shared.
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(Resp::text).collect::<Vec<_>>());
    assert_eq!(count(&answers, "COALESCED"), 0, "an answer keyed for another tenant was shared");
    assert_eq!(fleet.calls() - calls, 2);
    assert!(fleet.stat("wasmcustom.holysheep.edge.other.hop_key_mismatch") >= 1, "the disagreement is counted");
    // The owners knew from each hop's configuration digest, counted and logged it, and
    // served (`fleet.config_mismatch` is `count` by default).
    assert_eq!(mismatches() - counted, 2, "both hops");
    let logged = "holysheep: a fleet node runs other settings of keys, scopes or prices (configuration digest";
    assert!(fleet.envoys().any(|e| e.log().contains(logged)), "the owner logs it");
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn owners_that_refuse_other_settings_answer_such_a_hop_503_with_no_call() {
    let fleet_of = |mismatch: &str| {
        format!(
            r#"{{"cache":{{"tenant_header":"x-tenant-id"}},"edge":{{"max_age_seconds":0}},
               "fleet":{{"cluster":"owners","nodes":2,"internal":true,"peer_sans":["{}"],"config_mismatch":"{mismatch}"}}}}"#,
            FLEET_SAN
        )
    };
    let fleet = Fleet::disagreeing(2, &fleet_of("refuse"), r#"{"edge":{"max_age_seconds":0}}"#, 0);
    let mismatches = || fleet.stat("wasmcustom.holysheep.fleet.config_mismatch");
    let (calls, counted) = (fleet.calls(), mismatches());
    let body = prompt("asked through a node that runs other settings");
    let r = request(fleet.publics()[0], "POST", PATH, &[("x-tenant-id", "alpha")], body.as_bytes()).expect("answer");
    let e = &r.json()["error"];
    assert_eq!(
        (r.status, e["type"].as_str(), e["code"].as_str()),
        (503, Some("server_error"), Some("fleet_config_mismatch"))
    );
    assert!(e["message"].as_str().is_some_and(|m| m.contains("configuration digest")), "{}", r.text());
    assert_eq!(fleet.calls(), calls, "nothing went to HolySheep");
    assert_eq!(mismatches() - counted, 1);
    // The same request again: refused again, not served from anything kept.
    let again =
        request(fleet.publics()[1], "POST", PATH, &[("x-tenant-id", "alpha")], body.as_bytes()).expect("answer");
    assert_eq!(again.status, 503);
    assert_eq!(fleet.calls(), calls);
    // A client that sends the owner's own digest through the forward node is still the
    // forward node's hop: a client's `x-holysheep-config` is taken off.
    let owners = holysheep_edge::core::config::Config::parse(fleet_of("refuse").as_bytes()).expect("config").digest;
    assert!(!r.text().contains(&owners), "the owner's digest is the log's, not the client's");
    let forged = [("x-tenant-id", "alpha"), ("x-holysheep-config", owners.as_str())];
    let r = request(fleet.publics()[0], "POST", PATH, &forged, body.as_bytes()).expect("answer");
    assert_eq!(r.status, 503, "still the forward node's own digest");
    assert_eq!(fleet.calls(), calls);
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn a_forward_nodes_waiter_keeps_its_own_no_cache() {
    // The owner's entry lives 1 s and may be served STALE for 10 minutes when HolySheep
    // fails; no near copies, one attempt a call.
    let config = r#"{"cache":{"ttl_seconds":1},"stale_if_error_seconds":600,"edge":{"max_age_seconds":0},
        "retry":{"max_attempts":1}}"#;
    let fleet = Fleet::start(1, config, 0);
    let public = fleet.publics()[0];
    let body = prompt("an answer that goes stale");
    let ask = |cache_control: Option<&'static str>| {
        let body = body.clone();
        std::thread::spawn(move || {
            let headers: Vec<(&str, &str)> = cache_control.map(|c| vec![("cache-control", c)]).unwrap_or_default();
            request(public, "POST", PATH, &headers, body.as_bytes()).expect("answer")
        })
    };
    assert_eq!(ask(None).join().expect("client").cache(), "MISS");
    // Past the entry's second, HolySheep fails slowly, then at once.
    std::thread::sleep(Duration::from_millis(1_100));
    let slow = Fault { status: Some(503), delay_ms: 1_500, ..Fault::default() };
    fleet.mock.mock.plan(vec![slow, Fault { status: Some(503), ..Fault::default() }]);
    let calls = fleet.calls();
    let plain = ask(None);
    host_test::stack::poll_until(|| fleet.calls() > calls, "the plain request's call never left");
    // A no-cache request joins the plain one's flight on the forward node: when the owner
    // answers STALE, it is not handed that, as on the owner it would not be; it goes on by
    // itself and gets HolySheep's error.
    let no_cache = ask(Some("no-cache"));
    let plain = plain.join().expect("client");
    assert_eq!((plain.status, plain.cache()), (200, "STALE"), "{}", plain.text());
    let no_cache = no_cache.join().expect("client");
    assert_eq!(
        no_cache.status,
        503,
        "a no-cache request was handed a stale answer: {} {}",
        no_cache.cache(),
        no_cache.text()
    );
    assert_eq!(fleet.calls() - calls, 2, "the no-cache request's own call");
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn a_node_lost_is_routed_around_and_no_client_hangs() {
    let mut fleet = Fleet::start(3, r#"{"edge":{"max_age_seconds":0}}"#, 1_500);
    let survivors: Vec<SocketAddr> = fleet.publics()[..2].to_vec();
    let lost = fleet.live().nth(2).expect("node 2").owner.to_string();
    // Nine prompts, three of them owned by node 2 (found by asking with `no-store`, which
    // leaves nothing in any cache), in flight through node 0; node 2 dies while HolySheep is
    // still answering: the requests it owned are retried on another owner.
    fleet.mock.mock.set_latency_ms(0);
    let (mut owned, mut others) = (Vec::new(), Vec::new());
    for i in 0.. {
        if owned.len() == 3 && others.len() == 6 {
            break;
        }
        assert!(i < 500, "node 2 owns none of 500 prompts");
        let body = prompt(&format!("in flight {i}"));
        let headers = [("authorization", "Bearer sk-fleet"), ("cache-control", "no-store")];
        let r = request(survivors[0], "POST", PATH, &headers, body.as_bytes()).expect("answer");
        assert_eq!(r.status, 200, "{}", r.text());
        match (r.header("x-holysheep-owner") == Some(lost.as_str()), owned.len() < 3, others.len() < 6) {
            (true, true, _) => owned.push(body),
            (false, _, true) => others.push(body),
            _ => {}
        }
    }
    fleet.mock.mock.set_latency_ms(1_500);
    let bodies: Vec<String> = owned.iter().chain(&others).cloned().collect();
    let targets = bodies.iter().map(|b| (survivors[0], b.clone())).collect();
    let flying = std::thread::spawn(move || spread(targets));
    let probes = fleet.calls();
    host_test::stack::poll_until(|| fleet.calls() >= probes + 9, "the nine calls never reached HolySheep");
    fleet.kill(2);
    let answers = flying.join().expect("clients");
    assert!(
        answers.iter().all(|r| r.status == 200),
        "{:?}",
        answers.iter().map(|r| (r.status, r.text())).collect::<Vec<_>>()
    );
    // The three node 2 owned were answered by another owner.
    for r in &answers[..3] {
        let owner = r.header("x-holysheep-owner");
        assert!(owner.is_some_and(|o| o != lost), "a request node 2 owned was answered by {owner:?}");
    }

    // At once (before any health check noticed), every prompt on the survivors succeeds.
    fleet.mock.mock.set_latency_ms(0);
    let bodies: Vec<String> = (0..30).map(|i| prompt(&format!("after the loss {i}"))).collect();
    let answers = spread(round_robin(&survivors, bodies.clone()));
    assert!(answers.iter().all(|r| r.status == 200), "{:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
    // Once the rings forgot the node, the same prompts are answered by their owners.
    fleet.await_one_ring(2);
    let again = spread(round_robin(&survivors, bodies));
    assert!(again.iter().all(|r| r.status == 200));
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}

#[test]
fn nodes_that_cannot_ask_the_model_owner_admit_only_their_share() {
    // The owners look for the secret in a variable that is not set: no node can ask. (Their
    // listeners are open: with no secret, one serving only the fleet would refuse it all.)
    let config = r#"{"fleet":{"cluster":"owners","nodes":3,"peer_secret_env":"HOLYSHEEP_NO_SUCH_SECRET","internal":false},
                     "models":{"deepseek-v3":{"requests_per_minute":1,"burst":6}}}"#;
    let fleet = Fleet::start(3, config, 0);
    let calls_before = fleet.calls();
    let bodies = (0..30).map(|i| prompt_for("deepseek-v3", &format!("alone {i}"))).collect();
    let answers = spread(round_robin(&fleet.publics(), bodies));
    let admitted = answers.iter().filter(|r| r.status == 200).count();
    assert!(answers.iter().all(|r| r.status == 200 || r.status == 429));
    // Each owner admits its own share of the burst (6 / 3 = 2) of the prompts it owns.
    let mut by_owner: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for r in &answers {
        let owner = r.header("x-holysheep-owner").expect("every answer names its owner").to_owned();
        let (owned, ok) = by_owner.entry(owner).or_default();
        *owned += 1;
        *ok += usize::from(r.status == 200);
    }
    for (owner, (owned, ok)) in &by_owner {
        assert_eq!(*ok, (*owned).min(2), "{owner} owns {owned} prompts and admits its share of 2");
    }
    assert_eq!(admitted, by_owner.values().map(|(owned, _)| (*owned).min(2)).sum::<usize>());
    assert_eq!(fleet.calls() - calls_before, admitted as u64);
    assert!(fleet.stat("wasmcustom.holysheep.deepseek-v3.fleet_local_share") >= 30, "every admission counted");
    assert_eq!(fleet.crashes(), Vec::<String>::new());
}
