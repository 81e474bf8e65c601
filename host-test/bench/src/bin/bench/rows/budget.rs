//! What a tenant's dollar budget costs a HIT and a MISS, kept per process and in etcd.

use crate::load::{expect_all, load, repeat_at, unique_prompts, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::sha256_hex;

/// What a budget kept in etcd costs, alternating in one run: the load's tenant (`Bearer
/// bench`) without a budget on one Envoy, and with a dollar budget whose spend the spend
/// store (a real etcd) keeps on another. A HIT never touches the budget nor the store; a
/// MISS reserves and settles in shared data, and its spend is written behind once a round.
pub fn budget_rows(
    r: &mut Report,
    mock: &Running,
    rounds: usize,
    (conns, secs): (usize, u64),
    hit_prompt: &str,
) -> std::io::Result<()> {
    let etcd = host_test::etcd::Etcd::start()?;
    let tenant = |budget: &str, store: &str| {
        format!(
            r#"{{"models":{{"gpt-4.1":{{"usd_per_mtok_input":2,"usd_per_mtok_output":8}}}},{store}
                "tenants":{{"t":{{"keys_sha256":["{}"]{budget}}}}}}}"#,
            sha256_hex(b"bench")
        )
    };
    let budget = r#","usd_per_day":1000000"#;
    let plain = Envoy::start(&Options::new(&tenant("", ""), mock.addr))?;
    let in_memory = Envoy::start(&Options::new(&tenant(budget, ""), mock.addr))?;
    let mut opts = Options::new(&tenant(budget, r#""budget_store":{"cluster":"etcd"},"#), mock.addr);
    opts.extra_clusters = etcd.cluster();
    let budgeted = Envoy::start(&opts)?;
    for e in [&plain, &in_memory, &budgeted] {
        request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], hit_prompt.as_bytes())?;
    }
    println!();
    let hits = alternate(
        rounds,
        &mut [&mut || expect_all(repeat_at(plain.edge, conns, secs, hit_prompt), "HIT"), &mut || {
            expect_all(repeat_at(budgeted.edge, conns, secs, hit_prompt), "HIT")
        }],
    );
    let [plain_hit, budget_hit] = &hits[..] else { unreachable!("two rows") };
    let hit_ratio = paired(budget_hit, plain_hit, throughput);
    let (plain_prompts, memory_prompts) = (unique_prompts("unbudgeted"), unique_prompts("in memory"));
    let budget_prompts = unique_prompts("budgeted");
    let misses = alternate(
        rounds,
        &mut [
            &mut || expect_all(load(plain.edge, conns, secs, plain_prompts.clone()), "MISS"),
            &mut || expect_all(load(in_memory.edge, conns, secs, memory_prompts.clone()), "MISS"),
            &mut || expect_all(load(budgeted.edge, conns, secs, budget_prompts.clone()), "MISS"),
        ],
    );
    let [plain_miss, memory_miss, budget_miss] = &misses[..] else { unreachable!("three rows") };
    let miss_ratio = paired(budget_miss, plain_miss, throughput);
    let memory_ratio = paired(memory_miss, plain_miss, throughput);
    let store_ratio = paired(budget_miss, memory_miss, throughput);
    let mut medians = hits.into_iter().map(median);
    r.row("edge HIT, tenant without a budget", medians.next().expect("a row"));
    r.row("edge HIT, budgeted tenant, spend in etcd", medians.next().expect("a row"));
    let mut medians = misses.into_iter().map(median);
    r.row("edge MISS, tenant without a budget", medians.next().expect("a row"));
    r.row("edge MISS, budgeted tenant, spend per process", medians.next().expect("a row"));
    r.row("edge MISS, budgeted tenant, spend in etcd", medians.next().expect("a row"));
    r.ratio("budgeted HIT (spend store) / unbudgeted HIT", hit_ratio, "no store call on a HIT");
    r.ratio("budgeted MISS (spend store) / unbudgeted MISS", miss_ratio, "goal >= 0.95");
    r.ratio("budgeted MISS (per process) / unbudgeted MISS", memory_ratio, "the budget's own cost");
    r.ratio("budgeted MISS (spend store) / budgeted MISS (per process)", store_ratio, "the store's cost");
    let stored = etcd.get("holysheep/budget/t").unwrap_or_default();
    r.note(format!("spend store after the budgeted rows: {stored}"));
    Ok(())
}
