//! One round of byte messages (grid-core's `comm::round`): every rank sends each peer one
//! message and receives exactly one from each. Each receive is posted before the sends, into
//! room for the longest message a peer of this library sends in a round (the caller's
//! `capacity`), so that ranks that disagree on a collective's counts still exchange their
//! fingerprints: no well-formed message is truncated, and MPI writes nothing past a receive
//! (a longer one fails with `MPI_ERR_TRUNCATE`). Posting first lets an eager message land in
//! place, without passing through Open MPI's buffer of unexpected messages.

use super::comm::{Comm, CANCEL_GRACE};
use super::wait::{cancel_all, null_request, statuses, wait_all, Stop};
use super::{count, datatype, int, rc, RawError, R};
use grid_core::DType;
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::atomic::AtomicBool;

/// Why a round stopped before every message arrived, and the first peer (in the order given)
/// whose message had not arrived.
pub(crate) type Missing = (Stop, usize);

impl Comm {
    /// Receives one message from every rank of `from` into `recv` (`capacity` bytes each, in
    /// that order), and sends `bytes[offset..offset + len]` to `peer` for every `(peer, offset,
    /// len)` of `sends`, all with `tag`, then completes all of them under `abort` (the caller's
    /// watch ends the job at the time limit). Returns the length of each received message.
    ///
    /// When the communicator is aborted before every message arrived, the receives still
    /// active are cancelled and the reason comes back with the first peer whose message had
    /// not arrived. A send that does not complete within a second after that (Open MPI cannot
    /// cancel one), or a receive that can no longer be cancelled, calls `stuck`, which ends the
    /// job.
    // `stuck` never returns (it ends the process): what follows its call is unreachable.
    #[allow(unreachable_code, clippy::too_many_arguments)]
    pub(crate) fn round_within(
        &self,
        bytes: &[u8],
        sends: &[(usize, usize, usize)],
        recv: &mut [u8],
        capacity: usize,
        from: &[usize],
        tag: u32,
        abort: &AtomicBool,
        stuck: &dyn Fn(Stop) -> std::convert::Infallible,
    ) -> R<Result<Vec<usize>, Missing>> {
        let tag = int("tag", tag as usize)?;
        let byte = datatype(DType::U8);
        let cap = count(capacity)?;
        if capacity
            .checked_mul(from.len())
            .is_none_or(|need| need > recv.len())
        {
            return Err(RawError::msg(format!(
                "internal: {} receives of {capacity} bytes in {} bytes",
                from.len(),
                recv.len()
            )));
        }
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(from.len() + sends.len());
        let mut posted: R<()> = Ok(());
        for (&peer, room) in from.iter().zip(recv.chunks_exact_mut(capacity)) {
            let mut req = null_request();
            posted = int("peer", peer).and_then(|p| {
                // SAFETY: `room` holds `capacity` bytes (MPI writes at most that many, else
                // MPI_ERR_TRUNCATE) and stays exclusively borrowed (through `recv`) until this
                // function returns, which is only once no request is active (or never:
                // `stuck` ends the process).
                rc(unsafe {
                    ffi::MPI_Irecv(
                        room.as_mut_ptr().cast(),
                        cap,
                        byte,
                        p,
                        tag,
                        self.raw,
                        &mut req,
                    )
                })
            });
            if posted.is_err() {
                break;
            }
            reqs.push(req);
        }
        let receives = reqs.len();
        for &(peer, offset, len) in sends {
            if posted.is_err() {
                break;
            }
            let Some(msg) = offset
                .checked_add(len)
                .and_then(|end| bytes.get(offset..end))
            else {
                posted = Err(RawError::msg(format!(
                    "internal: message {offset}..+{len} outside {} bytes",
                    bytes.len()
                )));
                break;
            };
            let mut req = null_request();
            posted = count(len).and_then(|n| {
                let p = int("peer", peer)?;
                // SAFETY: `msg` holds `n` bytes and stays borrowed (through `bytes`) until this
                // function returns, which is only once no request is active (or never).
                rc(unsafe {
                    ffi::MPI_Isend(msg.as_ptr().cast(), n, byte, p, tag, self.raw, &mut req)
                })
            });
            if posted.is_ok() {
                reqs.push(req);
            }
        }
        let mut st = statuses(reqs.len());
        let why = match posted.and_then(|()| wait_all(&mut reqs, &mut st, None, abort)) {
            Ok(Ok(())) => {
                let mut got = Vec::with_capacity(receives);
                for s in &st[..receives] {
                    let mut n: c_int = 0;
                    // SAFETY: `s` was written by the completing test.
                    rc(unsafe { ffi::MPI_Get_count(s, byte, &mut n) })?;
                    got.push(
                        usize::try_from(n)
                            .map_err(|_| RawError::msg(format!("MPI_Get_count returned {n}")))?,
                    );
                }
                return Ok(Ok(got));
            }
            Ok(Err(why)) => Ok(why),
            Err(e) => Err(e),
        };
        // Aborted, a post failed or a request failed: cancel the receives still active, let the
        // sends finish within a grace period, and end the job if anything stays active.
        let left = cancel_all(&mut reqs, &mut st, CANCEL_GRACE)?;
        if left.iter().any(Option::is_none) {
            match stuck(why.as_ref().map_or(Stop::Timeout, |w| *w)) {}
        }
        let missing = from
            .iter()
            .zip(&left[..receives.min(left.len())])
            .find(|(_, l)| **l == Some(true))
            .map_or(from.first().copied().unwrap_or(0), |(&p, _)| p);
        why.map(|w| Err((w, missing)))
    }
}
