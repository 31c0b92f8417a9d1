//! `cargo xtask bench gloo`: Gloo's benchmark and MPI's, in one run, then one table that puts
//! them side by side (same operations, sizes and rank counts).

use crate::external::{run_external_capture, BENCHES};
use crate::util::on_path;
use std::collections::BTreeMap;

/// (op, ranks, bytes) -> the bytes label and the row's time columns.
type Rows = BTreeMap<(String, usize, u64), (String, Vec<String>)>;

/// `8 B`, `2 KiB`, `64 MiB` -> bytes (0 if unreadable, which sorts first).
fn bytes(label: &str) -> u64 {
    let mut it = label.split_whitespace();
    let n: u64 = it.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    match it.next() {
        Some("KiB") => n << 10,
        Some("MiB") => n << 20,
        Some("GiB") => n << 30,
        _ => n,
    }
}

fn cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

/// Rows of gloo-bench: `| op | ranks | bytes | trait µs | direct µs | ...`.
fn gloo_rows(text: &str) -> Rows {
    let mut rows = Rows::new();
    for l in text.lines().filter(|l| l.starts_with("| ")) {
        let c = cells(l);
        if c.len() >= 5 {
            if let Ok(n) = c[1].parse::<usize>() {
                let key = (c[0].clone(), n, bytes(&c[2]));
                rows.insert(key, (c[2].clone(), vec![c[3].clone(), c[4].clone()]));
            }
        }
    }
    rows
}

/// Rows of mpi-bench's collectives sections: `## Collectives, N ranks` then
/// `| op | bytes | samples | ours µs | rsmpi µs | ...`.
fn mpi_rows(text: &str) -> Rows {
    let mut rows = Rows::new();
    let mut ranks = None;
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("## Collectives, ") {
            ranks = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<usize>().ok());
        } else if let (Some(n), true) = (ranks, l.starts_with("| ")) {
            let c = cells(l);
            if c.len() >= 5 && c[2].parse::<usize>().is_ok() {
                let key = (c[0].clone(), n, bytes(&c[1]));
                rows.insert(key, (c[1].clone(), vec![c[3].clone(), c[4].clone()]));
            }
        }
    }
    rows
}

pub fn main(args: &[String]) -> i32 {
    let mut quick = false;
    for a in args {
        match a.as_str() {
            "--quick" => quick = true,
            other => {
                eprintln!("xtask bench gloo: unknown argument '{other}' (usage: cargo xtask bench gloo [--quick])");
                return 2;
            }
        }
    }
    let gloo = BENCHES.iter().find(|(n, _)| *n == "gloo").map(|(_, e)| e);
    let mpi = BENCHES.iter().find(|(n, _)| *n == "mpi").map(|(_, e)| e);
    let (Some(gloo), Some(mpi)) = (gloo, mpi) else {
        eprintln!("xtask: the benchmark table lacks gloo or mpi");
        return 1;
    };
    let q: Vec<String> = if quick {
        vec!["--quick".into()]
    } else {
        vec![]
    };
    let Some(gloo_out) = run_external_capture(gloo, &q) else {
        return 1;
    };
    print!("{gloo_out}");
    if !on_path("mpirun") {
        println!("\nMPI is not installed (no mpirun on PATH): no MPI column.");
        return 0;
    }
    let Some(mpi_out) = run_external_capture(mpi, &q) else {
        return 1;
    };
    print!("{mpi_out}");
    let (g, m) = (gloo_rows(&gloo_out), mpi_rows(&mpi_out));
    println!("\n## Gloo beside MPI (this run; µs per call, median, slowest rank)\n");
    println!("| op | ranks | bytes | Gloo (trait) | Gloo direct | MPI (trait) | rsmpi direct | Gloo / MPI |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut n = 0;
    for (key, (label, gv)) in &g {
        if let Some((_, mv)) = m.get(key) {
            let ratio = match (gv[0].parse::<f64>(), mv[0].parse::<f64>()) {
                (Ok(a), Ok(b)) if b > 0.0 => format!("{:.1}x", a / b),
                _ => "-".into(),
            };
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                key.0, key.1, label, gv[0], gv[1], mv[0], mv[1], ratio
            );
            n += 1;
        }
    }
    if n == 0 {
        eprintln!(
            "xtask: no common rows between the Gloo and MPI reports (did their formats change?)"
        );
        return 1;
    }
    0
}
