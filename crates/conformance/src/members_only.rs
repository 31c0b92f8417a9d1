//! What the members-only creation tests of every backend share: the layout on which torch's
//! `use_local_synchronization` deadlocks (Megatron's families at world 8, tp 2, pp 2;
//! pytorch/pytorch#173608), its families that create distinct communicators, the exhaustive set
//! of family orders to create them in, an all-reduce check of a created group, and a deadlock
//! guard.

use grid_core::{
    Communicator, CommunicatorExt, Error, FamilyLevel, LayoutConfig, LayoutPlan, ReduceOp, Result,
};
use std::collections::HashSet;
use std::time::Duration;

/// The torch-deadlock layout: world 8, tp 2, pp 2.
pub fn torch_deadlock_plan() -> Result<LayoutPlan> {
    LayoutPlan::new(LayoutConfig {
        tp: 2,
        pp: 2,
        ..LayoutConfig::new(8)
    })
}

/// The family levels that create distinct communicators (the first of each group signature),
/// in Megatron's order.
pub fn distinct_families(plan: &LayoutPlan) -> Result<Vec<FamilyLevel>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for fl in plan.family_levels() {
        if seen.insert(plan.group_signature(fl)?) {
            out.push(fl);
        }
    }
    Ok(out)
}

/// The family orders to run, an exhaustive set for members-only creation: for every family `f`
/// and every set `s` of the other families, the order "`s` (Megatron's order), `f`, the rest".
/// A creation's outcome depends only on the family created and on the set of families created
/// before it on the rank (what any counter-based name, torch's included, is a function of), and
/// every one of the n! orders creates each family after some such set: these n * 2^(n-1) orders
/// reach every state the n! orders reach (9 families: 2304 orders instead of 362880).
pub fn family_orders(n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    for f in 0..n {
        for mask in 0u32..(1 << n) {
            if mask & (1 << f) != 0 {
                continue;
            }
            let mut order: Vec<usize> = (0..n).filter(|i| mask & (1 << i) != 0).collect();
            order.push(f);
            order.extend((0..n).filter(|&i| i != f && mask & (1 << i) == 0));
            out.push(order);
        }
    }
    out
}

/// All-reduces `rank` over `c` and checks the sum equals the sum of `c`'s world ranks (`what`
/// names the group in the error).
pub fn sum_check<C: Communicator + ?Sized>(c: &C, what: &str, rank: usize) -> Result<()> {
    let mut s = [0i64];
    c.all_reduce_into(&[rank as i64][..], &mut s[..], ReduceOp::Sum)?;
    let want: usize = c.global_ranks().iter().sum();
    if s[0] != want as i64 {
        return Err(Error::Invalid(format!(
            "{what}: all-reduce {} want {want}",
            s[0]
        )));
    }
    Ok(())
}

/// Runs `f` on a thread and panics (failing the test) if it does not finish within `limit`: a
/// deadlock.
pub fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}: a deadlock")
        }
        Err(e) => panic!("the run failed (see the panic above): {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_permutations_and_exhaustive_in_size() {
        let orders = family_orders(4);
        assert_eq!(orders.len(), 4 * 8);
        for o in &orders {
            let mut s = o.clone();
            s.sort_unstable();
            assert_eq!(s, vec![0, 1, 2, 3]);
        }
        let plan = torch_deadlock_plan().unwrap();
        assert_eq!(distinct_families(&plan).unwrap().len(), 9);
    }
}
