//! The semantic tier: a MISS with it against an exact MISS, a SEMANTIC answer against an
//! exact HIT, in a partition of one question and of a full page.

use crate::load::{expect_all, load, unique_prompts, Prompts, PATH};
use crate::report::Report;
use crate::stats::{alternate, median, paired, throughput};
use host_test::client::request;
use host_test::envoy::{Envoy, Options};
use host_test::mock::Running;
use host_test::stack::prompt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The semantic tier, alternating in one run with an Envoy without it (same mock, the
/// embedding model's own 1536 dimensions): MISS with the tier vs exact MISS, SEMANTIC vs
/// exact HIT, and SEMANTIC in a partition of one question vs in one of a full page.
pub fn semantic_rows(r: &mut Report, rounds: usize, (conns, secs): (usize, u64)) -> std::io::Result<()> {
    let mock = Running::start(None, 0)?;
    // Room for every MISS of the rows: no answer a HIT or SEMANTIC row needs is evicted.
    let cache = r#""cache":{"max_entries":400000}"#;
    let plain = Envoy::start(&Options::new(&format!("{{{cache}}}"), mock.addr))?;
    // An embedding slower than the default bound on two busy cores would make a MISS.
    let semantic = r#""semantic":{"enabled":true,"timeout_ms":5000}"#;
    let mut opts = Options::new(&format!("{{{cache},{semantic}}}"), mock.addr);
    opts.api_key = Some("sk-bench-semantic".into());
    let tier = Envoy::start(&opts)?;
    let (one, full) = ("One question here.", "A full page here.");
    let question = "What is the capital of France?";
    // The questions the HIT and SEMANTIC rows are answered from, asked before each round;
    // a paraphrase then checks that the partition still finds them (a page shared with
    // the MISS row's partition would have let them go: the bench stops and says so).
    let warm = |e: &Envoy, system: &str, n: usize| -> std::io::Result<()> {
        for i in 0..n {
            let other = if i == 0 { question.to_owned() } else { format!("Question number {i} about something else?") };
            request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], asked(system, &other).as_bytes())?;
        }
        Ok(())
    };
    let found = |e: &Envoy, system: &str| {
        let check = asked(system, "WHAT is the capital of France");
        let r = request(e.edge, "POST", PATH, &[("authorization", "Bearer bench")], check.as_bytes()).expect("answer");
        assert_eq!(r.cache(), "SEMANTIC", "the partition of '{system}' lost its question");
    };
    // One sequence of paraphrases per partition for all rounds: each request a new one.
    let (one_paraphrases, full_paraphrases) = (paraphrases(one), paraphrases(full));
    let run = |addr: SocketAddr, body: Prompts, label: &'static str| expect_all(load(addr, conns, secs, body), label);
    // One sequence of new questions for all rounds: a later round's are new too.
    let (exact_misses, tier_misses) = (unique_prompts("exact miss"), unrelated_questions());
    println!();
    let rows = alternate(
        rounds,
        &mut [
            &mut || run(plain.edge, exact_misses.clone(), "MISS"),
            &mut || run(tier.edge, tier_misses.clone(), "MISS"),
            &mut || {
                warm(&plain, one, 1).expect("warm");
                let same = asked(one, question);
                run(plain.edge, Arc::new(move || same.clone()), "HIT")
            },
            &mut || {
                warm(&tier, one, 1).expect("warm");
                found(&tier, one);
                run(tier.edge, one_paraphrases.clone(), "SEMANTIC")
            },
            &mut || {
                warm(&tier, full, SEMANTIC_PAGE).expect("warm");
                found(&tier, full);
                run(tier.edge, full_paraphrases.clone(), "SEMANTIC")
            },
        ],
    );
    let [exact_miss, tier_miss, hit, semantic, semantic_full] = &rows[..] else { unreachable!("five rows") };
    let ratios = [
        ("MISS with the semantic tier / exact MISS throughput", paired(tier_miss, exact_miss, throughput)),
        ("SEMANTIC / exact HIT throughput", paired(semantic, hit, throughput)),
        ("SEMANTIC, full page / one question throughput", paired(semantic_full, semantic, throughput)),
    ];
    let mut medians = rows.into_iter().map(median);
    for name in [
        "exact MISS (tier off)",
        "MISS with the semantic tier",
        "exact HIT (tier off)",
        "SEMANTIC, partition of one question",
        "SEMANTIC, partition of 64 questions",
    ] {
        r.row(name, medians.next().expect("a row"));
    }
    for (what, value) in ratios {
        r.ratio(what, value, "");
    }
    r.note(format!("semantic tier: mock embeddings answered {}", mock.mock.embeddings()));
    Ok(())
}

/// A chat body asking `question` under `system`, at temperature 0.
pub fn asked(system: &str, question: &str) -> String {
    serde_json::json!({"model": "gpt-4.1", "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    .to_string()
}

/// A new question at each call, sharing no word with any other (the mock's embedding puts
/// each word on one of its dimensions: questions that share a word or two can collide).
pub fn unrelated_questions() -> Prompts {
    let n = Arc::new(AtomicU64::new(0));
    Arc::new(move || {
        let i = n.fetch_add(1, Ordering::Relaxed);
        prompt(&format!("q{i}a q{i}b q{i}c q{i}d q{i}e q{i}f"))
    })
}

/// A new paraphrase of "what is the capital of france" at each call: the same words (the
/// mock's embedding ignores case), capitalised after the bits of a counter.
pub fn paraphrases(system: &'static str) -> Prompts {
    let n = Arc::new(AtomicU64::new(1));
    Arc::new(move || {
        let bits = n.fetch_add(1, Ordering::Relaxed);
        let mut letter = 0;
        let text: String = "what is the capital of france"
            .chars()
            .map(|c| {
                if !c.is_alphabetic() {
                    return c;
                }
                letter += 1;
                if bits >> (letter - 1) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        asked(system, &text)
    })
}

/// Questions a full page of the semantic index holds (`semantic::WAYS`).
pub const SEMANTIC_PAGE: usize = 64;
