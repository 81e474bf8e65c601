//! A verified tenant's HIT among 100 and 1,000 tenants against a HIT without tenants.

use crate::load::{expect_all, repeat_at, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::sha256_hex;
use std::net::SocketAddr;

/// A HIT with 100 and with 1,000 tenants configured (the key's digest looked up on every
/// request, the tenant's counters counted) against a HIT without tenants, alternating in
/// one run. The load's `Bearer bench` is the first tenant's key.
pub fn tenant_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    load: (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let (conns, secs) = load;
    let with = |n: usize| {
        let tenants: Vec<String> = (0..n)
            .map(|i| {
                let token = if i == 0 { "bench".to_owned() } else { format!("bench-tenant-{i}") };
                format!(r#""t{i}":{{"keys_sha256":["{}"]}}"#, sha256_hex(token.as_bytes()))
            })
            .collect();
        Envoy::start(&Options::new(&format!(r#"{{"tenants":{{{}}}}}"#, tenants.join(",")), mock.addr))
    };
    let (none, hundred, thousand) = (Envoy::start(&Options::new("{}", mock.addr))?, with(100)?, with(1000)?);
    for e in [&none, &hundred, &thousand] {
        request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    println!();
    let hit = |addr: SocketAddr| expect_all(repeat_at(addr, conns, secs, hit_prompt), "HIT");
    let rows = alternate(rounds, &mut [&mut || hit(none.edge), &mut || hit(hundred.edge), &mut || hit(thousand.edge)]);
    let [none_r, hundred_r, thousand_r] = &rows[..] else { unreachable!("three rows") };
    let (hundred_ratio, thousand_ratio) =
        (paired(hundred_r, none_r, throughput), paired(thousand_r, none_r, throughput));
    let mut medians = rows.into_iter().map(median);
    r.row("edge HIT, no tenants (paired)", medians.next().expect("a row"));
    r.row("edge HIT, 100 tenants", medians.next().expect("a row"));
    r.row("edge HIT, 1,000 tenants", medians.next().expect("a row"));
    r.ratio("HIT with 100 tenants / HIT without", hundred_ratio, "");
    r.ratio("HIT with 1,000 tenants / HIT without", thousand_ratio, "goal >= 0.95");
    Ok(())
}
