//! The bookkeeping of one run: passed and skipped checks, failure messages, and the agreement
//! over the parent that turns this rank's failures into a [`Failure`] every rank returns.

use crate::values::{close, Num};
use crate::{CheckRecord, Failure, Outcome, Report};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::fmt;

pub(crate) struct Ctx {
    pub(crate) rank: usize,
    pub(crate) report: Report,
    pub(crate) failures: Vec<String>,
}

impl Ctx {
    pub(crate) fn pass(&mut self, name: String) {
        self.report.checks.push(CheckRecord {
            name,
            outcome: Outcome::Passed,
        });
    }
    pub(crate) fn skip(&mut self, name: String, why: impl Into<String>) {
        self.report.checks.push(CheckRecord {
            name,
            outcome: Outcome::Skipped(why.into()),
        });
    }
    pub(crate) fn fail(&mut self, name: &str, msg: String) {
        self.failures.push(format!("{name}: {msg}"));
    }
    /// Records `ok` as passed, else the message.
    pub(crate) fn expect(&mut self, name: String, ok: bool, msg: impl FnOnce() -> String) {
        if ok {
            self.pass(name);
        } else {
            let m = msg();
            self.fail(&name, m);
        }
    }
    pub(crate) fn eq<T: PartialEq + fmt::Debug>(&mut self, name: String, expected: &T, actual: &T) {
        self.expect(name, expected == actual, || {
            format!("expected {expected:?}, got {actual:?}")
        });
    }
    /// Unwraps a communicator call, recording an error as a failure.
    pub(crate) fn ok<T>(&mut self, name: &str, r: grid_core::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(name, format!("unexpected error: {e}"));
                None
            }
        }
    }
    pub(crate) fn values<T: Num>(
        &mut self,
        name: String,
        op: ReduceOp,
        n: usize,
        expected: &[T],
        actual: &[T],
    ) {
        let ok = expected.len() == actual.len()
            && expected
                .iter()
                .zip(actual)
                .all(|(&e, &a)| close(op, n, e, a));
        self.expect(name, ok, || {
            format!("expected {expected:?}, got {actual:?}")
        });
    }

    /// Agreement over `parent`: every rank learns whether any rank failed in this section.
    pub(crate) fn agree(
        &mut self,
        parent: &dyn Communicator,
        section: &str,
    ) -> Result<(), Failure> {
        let mine = self.failures.len() as i64;
        let mut all = vec![0i64; parent.size()];
        if let Err(e) = parent.all_gather_into(&[mine], &mut all[..]) {
            self.failures.push(format!(
                "{section}: agreement all_gather over the parent failed: {e}"
            ));
            return Err(self.failure(section, vec![self.rank]));
        }
        let failed: Vec<usize> = all
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 0)
            .map(|(i, _)| parent.global_ranks().get(i).copied().unwrap_or(i))
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(self.failure(section, failed))
        }
    }

    pub(crate) fn failure(&mut self, section: &str, failed_ranks: Vec<usize>) -> Failure {
        Failure {
            rank: self.rank,
            section: section.to_string(),
            failed_ranks,
            messages: std::mem::take(&mut self.failures),
        }
    }
}

pub(crate) fn expect_err(
    ctx: &mut Ctx,
    name: String,
    r: grid_core::Result<()>,
    want: &str,
    pred: impl Fn(&Error) -> bool,
) {
    match r {
        Err(e) if pred(&e) => ctx.pass(name),
        Err(e) => ctx.fail(&name, format!("expected {want}, got error {e:?}")),
        Ok(()) => ctx.fail(&name, format!("expected {want}, got Ok")),
    }
}
