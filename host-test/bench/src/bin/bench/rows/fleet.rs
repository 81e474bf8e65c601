//! A fleet node's HIT: on the owner listener, from a near copy, through a forward hop; and
//! its first request of a prompt through a forward hop against a plain two-Envoy proxy hop.

use crate::floors::floor_listener;
use crate::load::{expect_all, load, load_as, unique_prompts, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{workspace_root, Envoy, Options};
use host_test::fleet::{Fleet, SECRET};
use std::net::SocketAddr;
use std::sync::Arc;

/// A fleet node's HIT four ways, alternating in one run: on the owner listener, through
/// the forward listener from its near copy, and through the forward listener of a node
/// without near copies (one hop to the owner listener), in plaintext (the nodes known by
/// the fleet's secret) and over mutual TLS. Then the first request of each prompt (a MISS)
/// through the forward hop against the same request through two plain Envoy proxies in a
/// row to the same mock (`plain` listeners: Envoy's router, no filter), through a plain
/// proxy in front of the callout floor (the least a MISS's owner can do through the ABI),
/// and through a plain proxy in front of the hop's own owner listener (the least a forward
/// node can do: the ratio against it is the forward node's own cost, and its ratio to two
/// plain proxies bounds what any forward node reaches in front of this owner).
pub fn fleet_rows(r: &mut Report, rounds: usize, (conns, secs): (usize, u64), hit_prompt: &str) -> std::io::Result<()> {
    let no_copies = r#"{"edge":{"max_age_seconds":0}}"#;
    // Each fleet runs until the rows are measured.
    let fleets = [Fleet::plain(1, "{}", 0), Fleet::plain(1, no_copies, 0), Fleet::start(1, no_copies, 0)];
    let node = |f: &Fleet| f.live().next().map(|n| (n.public, n.owner)).expect("a node");
    let (near, hop, tls) = (node(&fleets[0]), node(&fleets[1]), node(&fleets[2]));
    for (public, _) in [near, hop, tls] {
        request(public, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    let hit = |addr: SocketAddr| {
        let same = hit_prompt.to_owned();
        load(addr, conns, secs, Arc::new(move || same.clone()))
    };
    // The owner listener serves the fleet's nodes: the bench comes as one, with the secret.
    const AS_A_NODE: &[(&str, &str)] = &[("x-holysheep-peer-secret", SECRET)];
    let owner_hit = |addr: SocketAddr| {
        let same = hit_prompt.to_owned();
        load_as(addr, (PATH, AS_A_NODE), conns, secs, Arc::new(move || same.clone()))
    };
    // Without near copies, the forward node's concurrent repeats share one hop: the owner's
    // HIT reaches one of them and the others are COALESCED there.
    let hop_hit = |public: SocketAddr| {
        let s = hit(public);
        assert!(s.labels.iter().all(|l| l == "HIT" || l == "COALESCED"), "every answer was the owner's HIT");
        s
    };
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || expect_all(owner_hit(near.1), "HIT"),
            &mut || expect_all(hit(near.0), "HIT"),
            &mut || hop_hit(hop.0),
            &mut || hop_hit(tls.0),
        ],
    );
    let [owner_r, near_r, hop_r, tls_r] = &rows[..] else { unreachable!("four rows") };
    let (near_over_owner, hop_over_owner) = (paired(near_r, owner_r, throughput), paired(hop_r, owner_r, throughput));
    let tls_over_plain = paired(tls_r, hop_r, throughput);
    let mut medians = rows.into_iter().map(median);
    let owner_hit = r.row("fleet HIT on the owner listener", medians.next().expect("a row"));
    let near_hit = r.row("fleet HIT from a near copy (forward listener)", medians.next().expect("a row"));
    let hop_hit = r.row("fleet HIT through a forward hop", medians.next().expect("a row"));
    r.row("fleet HIT through a forward hop, mutual TLS", medians.next().expect("a row"));
    r.ratio("near-copy HIT / owner HIT throughput", near_over_owner, "goal >= 0.90");
    r.ratio("forward hop HIT / owner HIT throughput", hop_over_owner, "");
    r.ratio("forward hop HIT over mutual TLS / in plaintext", tls_over_plain, "the hop's TLS cost");
    let p50 = |row: usize| r.rows[row].1.p50_us as f64;
    let (near_p50, hop_p50) = (p50(near_hit) / p50(owner_hit).max(1.0), p50(hop_hit) / p50(owner_hit).max(1.0));
    r.ratio("near-copy HIT / owner HIT p50", near_p50, "");
    r.ratio("forward hop HIT / owner HIT p50", hop_p50, "");

    let mock = fleets[1].mock.addr;
    let far = Envoy::start(&Options::new("{}", mock))?;
    let near_plain = Envoy::start(&Options::new("{}", far.plain))?;
    // The same path with the ABI's callout at its end: a plain proxy in front of an Envoy
    // whose listener runs the callout floor (the owner's part of a MISS, at its least).
    let mut far_floor = Options::new("{}", mock);
    let callout = workspace_root().join("target/floors/wasm32-wasip1/release/floor_callout.wasm");
    far_floor.extra_listeners = floor_listener("floor_callout", &callout, "{}");
    let far_floor = Envoy::start(&far_floor)?;
    let floor_at = far_floor.listener("floor_callout").ok_or_else(|| std::io::Error::other("no floor_callout"))?;
    let near_floor = Envoy::start(&Options::new("{}", floor_at))?;
    // The same path with the forward node at its least: a plain proxy in front of the hop's
    // own owner listener (the bench passes the fleet's secret through it, as a node would;
    // not a node's configuration digest, so the owner's check of it counts as the forward
    // node's cost, and the bound is a little above what a hop could reach).
    let near_owner = Envoy::start(&Options::new("{}", hop.1))?;
    let plain_hop = |addr: SocketAddr, what: &'static str| {
        let s = load(addr, conns, secs, unique_prompts(what));
        assert!(s.labels.iter().all(|l| l == "-"), "the plain proxies and the floor answer without the edge");
        s
    };
    let forward_miss = unique_prompts("bench: a forward node's first request");
    let to_owner = unique_prompts("bench: through a plain proxy to the owner listener");
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || expect_all(load(hop.0, conns, secs, forward_miss.clone()), "MISS"),
            &mut || plain_hop(near_plain.plain, "bench: through two plain proxies"),
            &mut || plain_hop(near_floor.plain, "bench: through a plain proxy to the callout floor"),
            &mut || expect_all(load_as(near_owner.plain, (PATH, AS_A_NODE), conns, secs, to_owner.clone()), "MISS"),
        ],
    );
    let [hop_miss, plain, to_floor, to_owner] = &rows[..] else { unreachable!("four rows") };
    let miss_over_plain = paired(hop_miss, plain, throughput);
    let (miss_over_floor, floor_over_plain) =
        (paired(hop_miss, to_floor, throughput), paired(to_floor, plain, throughput));
    let (miss_over_owner, owner_over_plain) =
        (paired(hop_miss, to_owner, throughput), paired(to_owner, plain, throughput));
    let mut medians = rows.into_iter().map(median);
    r.row("fleet MISS through a forward hop", medians.next().expect("a row"));
    r.row("MISS through two plain Envoy proxies", medians.next().expect("a row"));
    r.row("MISS through a plain proxy to the callout floor", medians.next().expect("a row"));
    r.row("MISS through a plain proxy to the owner listener", medians.next().expect("a row"));
    r.ratio("forward hop MISS / two plain Envoy proxies", miss_over_plain, "goal >= 0.80");
    r.ratio("forward hop MISS / a plain proxy to the callout floor", miss_over_floor, "");
    r.ratio("a plain proxy to the callout floor / two plain Envoy proxies", floor_over_plain, "the ABI's callout");
    r.ratio("forward hop MISS / a plain proxy to the owner listener", miss_over_owner, "the forward node's own cost");
    r.ratio(
        "a plain proxy to the owner listener / two plain Envoy proxies",
        owner_over_plain,
        "the owner's MISS: the bound",
    );
    Ok(())
}
