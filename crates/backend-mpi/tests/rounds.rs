//! Checked collectives that run as one round of messages (`ROUND_MAX`, `DIRECT_MAX`): the
//! fingerprint and the data travel together, and ranks whose collectives take different forms
//! (one round, or the fingerprint alone then the MPI call) still meet in the same round.
//!
//! * ranks that disagree on a count, where one rank's collective fits one round and the others'
//!   does not (at 4 ranks, and at 2 where rounds carry at most `PAIR_ROUND_MAX`): the same `Error::CollectiveMismatch` on every rank, nobody's buffer written, and
//!   the communicator still in step afterwards, for every collective with a one-round form;
//! * an all-to-all-v (whose check needs a second exchange) against an all-reduce that fits one
//!   round: the mismatch on every rank;
//! * at 2 ranks, a broadcast of `ROUND_MAX` bytes (its round carries the data) against a larger
//!   one and against an all-reduce of as many bytes (fingerprint alone): the mismatch on both
//!   ranks; a matching one delivers the root's data.
//!
//! The conformance suite with every collective checked (`GRID_DEBUG=detail`), so that every
//! small collective of every dtype and reduction runs in its one-round form, is in
//! `tests/conformance.rs`.

use backend_mpi::{mpi_test, PAIR_ROUND_MAX, ROUND_MAX};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::time::Duration;

/// The time limit of the tests' collectives.
const LIMIT: Duration = Duration::from_secs(30);

/// The collectives with a one-round form.
const FORMS: [&str; 8] = [
    "all_reduce",
    "all_reduce_in_place",
    "all_gather",
    "all_gather_in_place",
    "reduce_scatter",
    "reduce_scatter_in_place",
    "broadcast",
    "all_to_all",
];

/// Runs collective `form` whose per-rank block (the message of its one-round form) has `k`
/// elements, on buffers filled with this rank's pattern; returns its result and whether every
/// buffer still holds its pattern afterwards.
fn run<C: Communicator>(c: &C, form: &str, k: usize) -> (grid_core::Result<()>, bool) {
    let (me, n) = (c.rank(), c.size());
    let pattern = |len: usize| -> Vec<f32> { (0..len).map(|i| (me * 1000 + i) as f32).collect() };
    let (a, mut b) = match form {
        "all_reduce" | "all_reduce_in_place" | "broadcast" => (pattern(k), pattern(k)),
        "all_gather" => (pattern(k), pattern(k * n)),
        "reduce_scatter" => (pattern(k * n), pattern(k)),
        _ => (pattern(k * n), pattern(k * n)),
    };
    let (a0, b0) = (a.clone(), b.clone());
    let r = match form {
        "all_reduce" => c.all_reduce_into(&a[..], &mut b[..], ReduceOp::Sum),
        "all_reduce_in_place" => c.all_reduce_in_place(&mut b[..], ReduceOp::Sum),
        "all_gather" => c.all_gather_into(&a[..], &mut b[..]),
        "all_gather_in_place" => c.all_gather_in_place(&mut b[..]),
        "reduce_scatter" => c.reduce_scatter_into(&a[..], &mut b[..], ReduceOp::Sum),
        "reduce_scatter_in_place" => c.reduce_scatter_in_place(&mut b[..], ReduceOp::Sum),
        "broadcast" => c.broadcast_into(&mut b[..], 0),
        "all_to_all" => c.all_to_all_into(&a[..], &mut b[..]),
        other => Err(Error::Invalid(format!("unknown form {other}"))),
    };
    let untouched = a == a0 && b == b0;
    (r, untouched)
}

/// A hash of `s` that every rank computes alike (FNV-1a), as two non-negative `i64`s' worth.
fn hash(s: &str) -> i64 {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (h >> 1) as i64
}

/// Whether every rank passed the same `v`.
fn same_everywhere<C: Communicator>(c: &C, v: i64) -> Result<bool, String> {
    let mut both = [v, -v];
    c.all_reduce_in_place(&mut both[..], ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    Ok(both[0] == -both[1])
}

/// Rank 0's block (`small` elements) fits one round, the others' is four times larger: rank 0
/// sends its fingerprint with its data, the others their fingerprint alone. Every rank returns
/// the same CollectiveMismatch, no buffer changes, and the ranks stay in step.
fn mismatch_between_forms<C: Communicator>(c: &C, small: usize) -> Result<(), String> {
    let n = c.size() as f32;
    let k = if c.rank() == 0 { small } else { 4 * small };
    for form in FORMS {
        let (r, untouched) = run(c, form, k);
        let text = match r {
            Err(e @ Error::CollectiveMismatch { .. }) => e.to_string(),
            other => return Err(format!("{form}: expected a mismatch, got {other:?}")),
        };
        if !untouched {
            return Err(format!("{form}: a buffer changed although the call failed"));
        }
        if !text.contains("count") {
            return Err(format!("{form}: the error does not name the count: {text}"));
        }
        if !same_everywhere(c, hash(&text))? {
            return Err(format!(
                "{form}: the ranks returned different errors; here: {text}"
            ));
        }
    }
    // Still in step: an agreeing all-reduce of each form's size.
    for k in [small, 4 * small] {
        let mut v = vec![1f32; k];
        c.all_reduce_in_place(&mut v[..], ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if v.iter().any(|&x| x != n) {
            return Err(format!("sum of {k} after the mismatches: {:?}", &v[..4]));
        }
    }
    Ok(())
}

// At 4 ranks rank 0's block is ROUND_MAX / 4 f32.
mpi_test!(
    mpi_round_mismatch_between_forms_np4,
    np = 4,
    timeout = 120,
    |rt| mismatch_between_forms(&rt.world().with_time_limit(LIMIT), ROUND_MAX / 4)
);

// At 2 ranks rounds carry at most PAIR_ROUND_MAX bytes of data.
mpi_test!(
    mpi_round_mismatch_between_forms_np2,
    np = 2,
    timeout = 120,
    |rt| mismatch_between_forms(&rt.world().with_time_limit(LIMIT), PAIR_ROUND_MAX / 4)
);

// At 2 ranks a broadcast's round carries up to ROUND_MAX bytes (only the root sends data): a
// broadcast of ROUND_MAX bytes against one four times larger, and against an all-reduce of
// ROUND_MAX bytes (whose round carries its fingerprint alone and must still receive the
// broadcast's whole message), fails alike on both ranks with nothing written; a matching one
// delivers the root's data.
mpi_test!(
    mpi_round_broadcast_of_round_max_np2,
    np = 2,
    timeout = 120,
    |rt| {
        let c = rt.world().with_time_limit(LIMIT);
        let me = c.rank();
        let k = ROUND_MAX / 4;
        let (r, untouched) = run(&c, "broadcast", if me == 0 { k } else { 4 * k });
        match r {
            Err(Error::CollectiveMismatch { .. }) if untouched => {}
            other => return Err(format!("broadcast of {k} against {}: {other:?}", 4 * k)),
        }
        let (r, untouched) = run(&c, if me == 0 { "broadcast" } else { "all_reduce" }, k);
        let text = match r {
            Err(e @ Error::CollectiveMismatch { .. }) if untouched => e.to_string(),
            other => return Err(format!("broadcast against all_reduce: {other:?}")),
        };
        // Each rank names its own call first, then what every rank called.
        if !text.contains("rank 0: broadcast, rank 1: all_reduce") {
            return Err(format!("the error does not name both operations: {text}"));
        }
        let mut b: Vec<f32> = (0..k).map(|i| (me * 1000 + i) as f32).collect();
        c.broadcast_into(&mut b[..], 1).map_err(|e| e.to_string())?;
        if b.iter().enumerate().any(|(i, &x)| x != (1000 + i) as f32) {
            return Err(format!("broadcast from rank 1: {:?}", &b[..4]));
        }
        Ok(())
    }
);

// An all-to-all-v (checked with its counts after the fingerprints) on rank 0 against an
// all-reduce of one round on the others: every rank reports the operations that differ.
mpi_test!(
    mpi_round_all_to_all_v_against_a_round_np3,
    np = 3,
    timeout = 120,
    |rt| {
        let c = rt.world().with_time_limit(Duration::from_secs(30));
        let n = c.size();
        let r = if c.rank() == 0 {
            c.all_to_all_v_into(
                &vec![1i32; 600 * n],
                &vec![600; n],
                &mut vec![0i32; 600 * n],
                &vec![600; n],
            )
        } else {
            c.all_reduce_in_place(&mut vec![1i32; 1024][..], ReduceOp::Sum)
        };
        let text = match r {
            Err(e @ Error::CollectiveMismatch { .. }) => e.to_string(),
            other => return Err(format!("expected a mismatch, got {other:?}")),
        };
        if !text.contains("operation") || !text.contains("all_to_all_v") {
            return Err(format!("the error does not name the operations: {text}"));
        }
        // Each rank's error names its own call first; what follows is the same everywhere.
        let what = text.split_once(": ").map_or(text.as_str(), |(_, w)| w);
        if !same_everywhere(&c, hash(what))? {
            return Err(format!("the ranks returned different errors; here: {text}"));
        }
        Ok(())
    }
);
