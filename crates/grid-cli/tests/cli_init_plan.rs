//! `grid init-plan`: exact text, JSON that matches the library's per-rank plans, the memory
//! estimate, `--verify`, errors (status 2, one line) and the scale targets.

mod common;
use common::cli::{json, run};
use grid_core::{Creation, InitPlan, LayoutConfig, LayoutPlan};
use serde_json::Value;
use std::time::{Duration, Instant};

const SUMMARY: &str = "\
Init plan of 8 ranks (tp 2, pp 2, cp 1, ep 1, etp 2, dp 2, expert dp 2), split creation
9 communicator kinds for 19 family levels (one split of the 8-rank world each, in this order):
    1  tp, tp_cp, expt_tp, tp_ep                       4 groups of 2
    2  pp                                              4 groups of 2
    3  mp, tp_ep_pp                                    2 groups of 4
    4  embd                                            4 groups of 2
    5  pos_embd                                        4 groups of 1, 4 of 8 ranks in one
    6  cp, ep                                          8 groups of 1
    7  tp_dp, tp_dp_cp                                 2 groups of 4
    8  dp, dp_cp, expt_dp, intra_dp_cp, intra_expt_dp  4 groups of 2
    9  intra_dist_opt                                  1 group of 8
Communicators per rank: 8 (rank 4) to 9 (rank 0); 33 in the world
Collective calls per rank: 10 on every rank (1 plan check + 9 splits); 80 in all
Memory per rank: 5.38 GiB (rank 4) to 6.05 GiB (rank 0); 45.69 GiB in the world (nccl estimate, 688 MiB of GPU memory per communicator: NVIDIA/nccl issues 964 and 864)
Verified: 8 ranks, 10 calls on every rank; the colours of all 9 communicator kinds partition the world as the groups say; 10 shared families serve identical groups (148 memberships checked)
";

const RANK5: &str = "\
Init plan of rank 5 in 8 ranks (tp 2, pp 2, cp 1, ep 1, etp 2, dp 2, expert dp 2), members-only creation
  call  op            colour       key  participants  communicator        families
     0  plan_check         -         -             8  -                   (all-gather of the plan fingerprint)
     1  create             2         -             2  2 ranks, rank 1     tp, tp_cp, expt_tp, tp_ep
     2  create             1         -             2  2 ranks, rank 1     pp
     3  create             0         -             4  4 ranks, rank 3     mp, tp_ep_pp
     4  create             1         -             2  2 ranks, rank 1     embd
     5  create             5         -             1  1 rank, rank 0      cp, ep
     6  create             1         -             4  4 ranks, rank 1     tp_dp, tp_dp_cp
     7  create             3         -             2  2 ranks, rank 0     dp, dp_cp, expt_dp, intra_dp_cp, intra_expt_dp
     8  create             0         -             8  8 ranks, rank 5     intra_dist_opt
Rank 5: 8 communicators serving 18 of 19 family levels, 9 collective calls
Memory: 8 communicators × 1.00 GiB = 8.00 GiB (--comm-memory)
";

#[test]
fn text_summary_and_one_rank() {
    let (code, out, err) = run(&[
        "init-plan",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--verify",
        "--backend",
        "nccl",
    ]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out, SUMMARY);
    let (code, out, err) = run(&[
        "init-plan",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--rank",
        "5",
        "--creation",
        "members-only",
        "--comm-memory",
        "1GiB",
    ]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out, RANK5);
}

fn demo(world: usize) -> LayoutPlan {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        cp: 2,
        ep: 4,
        etp: Some(1),
        dist_opt_instances: 2,
        ..LayoutConfig::new(world)
    })
    .unwrap()
}

const DEMO: [&str; 12] = [
    "--tp",
    "2",
    "--pp",
    "2",
    "--cp",
    "2",
    "--ep",
    "4",
    "--etp",
    "1",
    "--dist-opt-instances",
    "2",
];

fn args<'a>(world: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["init-plan", "--world-size", world];
    v.extend(DEMO);
    v.extend(extra);
    v
}

/// Every rank's JSON is the library's plan of that rank, and the summary adds them up.
#[test]
fn json_matches_the_library_on_every_rank() {
    let plan = demo(64);
    for (creation, name) in [
        (Creation::Split, "split"),
        (Creation::MembersOnly, "members-only"),
    ] {
        let init = InitPlan::new(&plan, creation).unwrap();
        let mut comms = Vec::new();
        for rank in 0..64 {
            let r = rank.to_string();
            let v = json(&args(
                "64",
                &[
                    "--rank",
                    &r,
                    "--creation",
                    name,
                    "--format",
                    "json",
                    "--comm-memory",
                    "1000",
                ],
            ));
            let mut want = serde_json::to_value(init.rank(rank).unwrap()).unwrap();
            let n = want["communicators"].as_u64().unwrap();
            want["memory"] = serde_json::json!({
                "bytes_per_communicator": 1000, "source": "--comm-memory", "bytes": 1000 * n
            });
            assert_eq!(v, want, "rank {rank} {name}");
            comms.push(n);
        }
        let s = json(&args("64", &["--creation", name, "--format", "json"]));
        assert_eq!(s["creation"], name);
        assert_eq!(s["world_size"], 64);
        assert_eq!(
            s["communicators"]["total"].as_u64(),
            Some(comms.iter().sum())
        );
        assert_eq!(
            s["communicators"]["max"].as_u64(),
            comms.iter().max().copied()
        );
        assert_eq!(s["memory"], Value::Null);
        assert_eq!(s["verify"], Value::Null);
        let fams: Vec<String> = s["shared"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|sh| sh["families"].as_array().unwrap().clone())
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        assert_eq!(fams.len() as u64, s["family_levels"].as_u64().unwrap());
    }
}

#[test]
fn memory_defaults_and_override() {
    let v = json(&args("64", &["--backend", "nccl", "--format", "json"]));
    let per = 688u64 << 20;
    assert_eq!(v["memory"]["bytes_per_communicator"], per);
    assert!(v["memory"]["source"]
        .as_str()
        .unwrap()
        .contains("NVIDIA/nccl issues 964 and 864"));
    let total = v["communicators"]["total"].as_u64().unwrap();
    assert_eq!(v["memory"]["per_rank"]["total"], per * total);
    assert_eq!(
        v["memory"]["per_rank"]["max"],
        per * v["communicators"]["max"].as_u64().unwrap()
    );
    for b in ["gloo", "mpi"] {
        let v = json(&args("64", &["--backend", b, "--format", "json"]));
        assert_eq!(v["memory"]["bytes_per_communicator"], 0);
    }
    // --comm-memory wins over --backend.
    let v = json(&args(
        "64",
        &[
            "--backend",
            "nccl",
            "--comm-memory",
            "2MB",
            "--format",
            "json",
        ],
    ));
    assert_eq!(v["memory"]["bytes_per_communicator"], 2_000_000);
    assert_eq!(v["memory"]["source"], "--comm-memory");
}

#[test]
fn verify_in_json() {
    for creation in ["split", "members-only"] {
        let v = json(&args(
            "512",
            &["--verify", "--creation", creation, "--format", "json"],
        ));
        assert_eq!(v["verify"]["ranks"], 512);
        assert_eq!(v["verify"]["creation"], creation);
        assert_eq!(
            v["verify"]["splits_checked"].as_u64().unwrap(),
            v["shared"].as_array().unwrap().len() as u64
        );
    }
}

#[test]
fn errors_exit_2_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["init-plan", "--world-size", "8", "--tp", "3"],
            "not divisible",
        ),
        (
            &["init-plan", "--world-size", "8", "--rank", "8"],
            "grid init-plan: --rank 8 is not a rank of the layout (valid: 0..=7)",
        ),
        (
            &[
                "init-plan",
                "--world-size",
                "8",
                "--rank-offset",
                "4",
                "--rank",
                "2",
            ],
            "grid init-plan: --rank 2 is not a rank of the layout (valid: 4..=11)",
        ),
        (
            &["init-plan", "--world-size", "8", "--creation", "lazy"],
            "grid init-plan: unknown creation 'lazy': valid creations are split and members-only",
        ),
        (
            &["init-plan", "--world-size", "8", "--backend", "ucc"],
            "grid init-plan: unknown backend 'ucc': valid backends are nccl, gloo and mpi",
        ),
        (
            &["init-plan", "--world-size", "8", "--comm-memory", "1.5GiB"],
            "grid init-plan: invalid value '1.5GiB' for --comm-memory: unknown unit '.5GiB': valid units are B, KiB, MiB, GiB, TiB, KB, MB, GB or TB",
        ),
        (
            &["init-plan", "--world-size", "8", "--comm-memory", "-1"],
            "grid init-plan: invalid value '-1' for --comm-memory: expected a number of bytes",
        ),
        (
            &["init-plan", "--world-size", "8", "--rank", "1", "--verify"],
            "grid init-plan: --rank cannot be used with --verify",
        ),
        (
            &["init-plan", "--world-size", "0"],
            "--world-size must be a positive integer, got 0",
        ),
        (
            &["init-plan", "--world-size", "8", "--pp", "1", "--vpp", "2"],
            "virtual pipeline",
        ),
    ];
    for (argv, want) in cases {
        let (code, out, err) = run(argv);
        assert_eq!(code, 2, "{argv:?}: {err}");
        assert_eq!(out, "", "{argv:?}");
        assert_eq!(err.lines().count(), 1, "{argv:?}: {err}");
        assert!(err.contains(want), "{argv:?}: {err}");
    }
}

/// The scale targets, through the built binary: the summary of the README's demo layout at
/// 131,072 ranks, and one rank of a 1,048,576-rank world. The bounds are generous for a debug
/// build on a shared machine; docs/grid-command.md has the release timings.
#[test]
fn scale_summary_and_one_rank() {
    let t = Instant::now();
    let (code, out, err) = run(&args("131072", &["--format", "json"]));
    let took = t.elapsed();
    assert_eq!((code, err.as_str()), (0, ""));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["world_size"], 131072);
    assert_eq!(v["calls"]["min"], v["calls"]["max"]);
    assert!(took < Duration::from_secs(10), "{took:?}");

    let t = Instant::now();
    let (code, out, err) = run(&args("1048576", &["--rank", "1048575", "--format", "json"]));
    let took = t.elapsed();
    assert_eq!((code, err.as_str()), (0, ""));
    let v: Value = serde_json::from_str(&out).unwrap();
    let want = serde_json::to_value(
        InitPlan::new(&demo(1 << 20), Creation::Split)
            .unwrap()
            .rank(1048575)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(v["calls"], want["calls"]);
    assert!(took < Duration::from_secs(2), "{took:?}");
}
