//! One round of byte messages (grid-core's `comm::round`): every rank sends each peer one
//! message and receives exactly one from each, of whatever length the peer sent. Receiving by
//! length (`MPI_Improbe`, then `MPI_Imrecv` into memory of the probed length) is what lets
//! ranks that disagree on a collective's counts still exchange their fingerprints: no receive
//! is ever shorter than its message, so nothing is truncated and nothing is written past a
//! buffer.

use super::comm::{Comm, CANCEL_GRACE};
use super::wait::{null_request, status, statuses, wait_all, Pace, Stop};
use super::{count, datatype, int, rc, RawError, R};
use grid_core::DType;
use mpi::ffi;
use std::os::raw::c_int;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Why a round stopped before every message arrived, and the first peer (in the order given)
/// whose message had not arrived.
pub(crate) type Missing = (Stop, usize);

impl Comm {
    /// Sends `bytes[offset..offset + len]` to `peer` for every `(peer, offset, len)` of
    /// `sends`, and receives one message from every rank of `from` (in that order in the
    /// result), all with `tag`, completing under `limit` and `abort`. Each peer is probed by
    /// its own rank, never `MPI_ANY_SOURCE`: a fast peer may already have sent its message
    /// of the next round, which MPI's ordering per sender keeps behind this one.
    ///
    /// When the limit passes or the communicator is aborted before every message arrived,
    /// returns the reason and the first peer still missing; no receive is then active (a
    /// message is received only once it is matched, and a matched one is received whole). A
    /// send that does not complete within a second after that (Open MPI cannot cancel one),
    /// or a matched receive that does not, calls `stuck`, which ends the job.
    // `stuck` never returns (it ends the process): what follows its call is unreachable.
    #[allow(unreachable_code, clippy::too_many_arguments)]
    pub(crate) fn round_within(
        &self,
        bytes: &[u8],
        sends: &[(usize, usize, usize)],
        from: &[usize],
        tag: u32,
        limit: Option<Duration>,
        abort: &AtomicBool,
        stuck: &dyn Fn(Stop) -> std::convert::Infallible,
    ) -> R<Result<Vec<Vec<u8>>, Missing>> {
        let tag = int("tag", tag as usize)?;
        let byte = datatype(DType::U8);
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(sends.len() + from.len());
        let mut posted = Ok(());
        for &(peer, offset, len) in sends {
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
            let step = (|| {
                let (n, p) = (count(msg.len())?, int("peer", peer)?);
                let mut req = null_request();
                // SAFETY: `msg` holds `n` bytes and stays borrowed (through `bytes`) until this
                // function returns, which is only once no request is active (or never: `stuck`
                // ends the process).
                unsafe {
                    rc(ffi::MPI_Isend(
                        msg.as_ptr().cast(),
                        n,
                        byte,
                        p,
                        tag,
                        self.raw,
                        &mut req,
                    ))?
                };
                Ok(req)
            })();
            match step {
                Ok(req) => reqs.push(req),
                Err(e) => {
                    posted = Err(e);
                    break;
                }
            }
        }
        // Received messages, in the order of `from`; `None` until matched.
        let mut got: Vec<Option<Vec<u8>>> = vec![None; from.len()];
        let mut outcome: R<Result<(), Missing>> = posted.map(Ok);
        if outcome.is_ok() {
            outcome = self.match_all(from, tag, &mut got, &mut reqs, limit, abort);
        }
        // Complete what was posted: everything, when every message was matched; otherwise the
        // sends and the matched receives, within a grace period.
        let grace = match outcome {
            Ok(Ok(())) => limit,
            _ => Some(CANCEL_GRACE),
        };
        let mut st = statuses(reqs.len());
        let never = AtomicBool::new(false);
        let waited = match outcome {
            Ok(Ok(())) => wait_all(&mut reqs, &mut st, grace, abort),
            _ => wait_all(&mut reqs, &mut st, grace, &never),
        };
        match waited {
            Ok(Ok(())) => {}
            Ok(Err(why)) => match stuck(why) {},
            Err(e) => {
                // A request failed and the others may still be active: wait for them a
                // little, then give up on the job if any is.
                let mut st = statuses(reqs.len());
                if !matches!(
                    wait_all(&mut reqs, &mut st, Some(CANCEL_GRACE), &never),
                    Ok(Ok(()))
                ) {
                    match stuck(Stop::Timeout) {}
                }
                return Err(outcome.err().unwrap_or(e));
            }
        }
        match outcome? {
            Ok(()) => Ok(Ok(got.into_iter().map(Option::unwrap_or_default).collect())),
            Err(missing) => Ok(Err(missing)),
        }
    }

    /// Probes every peer of `from` until each message is matched, receiving each (nonblocking,
    /// into `got`, requests appended to `reqs`) as soon as it is.
    fn match_all(
        &self,
        from: &[usize],
        tag: c_int,
        got: &mut [Option<Vec<u8>>],
        reqs: &mut Vec<ffi::MPI_Request>,
        limit: Option<Duration>,
        abort: &AtomicBool,
    ) -> R<Result<(), Missing>> {
        let byte = datatype(DType::U8);
        let mut pace = Pace::new(limit, abort);
        let mut left = from.len();
        loop {
            for (i, &peer) in from.iter().enumerate() {
                if got[i].is_some() {
                    continue;
                }
                let p = int("peer", peer)?;
                let mut flag: c_int = 0;
                // SAFETY: MPI_Message and MPI_Status are plain C handles/structs, written by
                // MPI_Improbe before they are read (only when `flag` is set).
                let mut message: ffi::MPI_Message = unsafe { std::mem::zeroed() };
                let mut st = status();
                // SAFETY: every out pointer is valid; probing touches no buffer.
                rc(unsafe {
                    ffi::MPI_Improbe(p, tag, self.raw, &mut flag, &mut message, &mut st)
                })?;
                if flag == 0 {
                    continue;
                }
                let mut n: c_int = 0;
                // SAFETY: `st` was written by the matching probe.
                rc(unsafe { ffi::MPI_Get_count(&st, byte, &mut n) })?;
                let len = usize::try_from(n)
                    .map_err(|_| RawError::msg(format!("MPI_Get_count returned {n}")))?;
                let buf = got[i].insert(vec![0u8; len]);
                let mut req = null_request();
                // SAFETY: `buf` holds exactly the `n` bytes of the matched message; its heap
                // memory does not move while `got` lives (only the Vec header is stored in
                // `got`), and the caller keeps `got` until no request is active.
                rc(unsafe {
                    ffi::MPI_Imrecv(buf.as_mut_ptr().cast(), n, byte, &mut message, &mut req)
                })?;
                reqs.push(req);
                left -= 1;
            }
            if left == 0 {
                return Ok(Ok(()));
            }
            if let Some(why) = pace.next()? {
                let first = from
                    .iter()
                    .zip(got.iter())
                    .find(|(_, g)| g.is_none())
                    .map_or(0, |(&p, _)| p);
                return Ok(Err((why, first)));
            }
        }
    }
}
