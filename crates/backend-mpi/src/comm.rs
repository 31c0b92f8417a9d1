//! [`MpiBackend`]: the front end's [`Backend`] over one MPI communicator, and
//! [`MpiCommunicator`], the communicator users hold (`Comm<MpiBackend>`).

use crate::peer_read::{self, Outcome, Reads, Reduction};
use crate::raw::{self, Immediate, P2p, Pending, RawError, Stop};
use crate::ring;
use crate::stage::{self, Plan};
use crate::watch::{self, Ending, Site, Watch};
use grid_core::comm::round::{self, RoundOp, FP_BYTES};
use grid_core::DeferredCheck;
use grid_core::{
    Backend, BufMut, BufRef, Comm, DType, Error, HostBuffer, HostSlice, HostSliceMut, LibraryError,
    Memory, MismatchCheck, Op, P2pOp, ReduceOp, Request, Result, Tensor, TimeLimit, Validated,
    Work,
};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BACKEND: &str = "mpi";

/// The size (bytes of a collective's larger buffer on a rank) from which the MPI backend checks
/// collectives by default ([`Backend::mismatch_check_default`]): 2 KiB, half the eager limit of
/// Open MPI's shared-memory transport (`btl_vader_eager_limit`, 4 KiB), below which a count
/// mismatch cannot crash a rank.
pub const CHECK_THRESHOLD: usize = 2 << 10;

/// Largest communicator whose mismatch checks travel as one round of messages (each rank sends
/// every other rank its fingerprint, with the collective's data when it fits, [`ROUND_MAX`],
/// [`PAIR_ROUND_MAX`] at 2 ranks): one message latency where the check's all-reduce takes
/// `log2 n` steps, at `n - 1` messages per rank. Larger communicators check with the
/// all-reduce ([`DeferredCheck::verify_with`]) on the duplicate communicator.
pub const DIRECT_MAX: usize = 16;

/// Largest payload (bytes) of one message of a checked collective that runs as one round
/// (grid-core's `comm::round`: the fingerprint and the data in one message to every rank), on
/// a communicator of 3 to [`DIRECT_MAX`] ranks: 8 KiB. A checked
/// collective with larger messages sends its fingerprint alone in the round, then runs the MPI
/// call. Measured at 4 ranks (docs/performance.md, *The check inside the collective*).
pub const ROUND_MAX: usize = 8 << 10;

/// [`ROUND_MAX`] on a communicator of 2 ranks: 4 KiB, except for broadcasts. There the check's
/// all-reduce is one exchange too, so a round saves only the separate exchange before the MPI
/// call, which pays at 2 KiB (the check's threshold) and not at 8 KiB, where the round's copies
/// into and out of its messages cost more (docs/performance.md, *The check inside the
/// collective*). A broadcast's round carries data from the root alone, and up to [`ROUND_MAX`]
/// it is one message where the check and `MPI_Bcast` are two exchanges: the 2-rank broadcast of
/// 8 KiB went from 0.83–0.85 of mpi4py's speed to 0.95–0.98 (docs/performance.md, *Against
/// the alternatives*).
pub const PAIR_ROUND_MAX: usize = 4 << 10;

/// The tag of the rounds' messages on the duplicate communicator (the `ring` module uses 1).
const ROUND_TAG: u32 = 2;

/// An MPI failure as [`Error::Library`]: the operation, the communicator, MPI's error code and
/// class and its message.
pub(crate) fn backend_err(op: &'static str, comm: &str, e: RawError) -> Error {
    let mut l = LibraryError::new(BACKEND, op, e.message).comm(comm);
    if let Some(c) = e.code {
        l = l.code(i64::from(c));
    }
    if let Some(c) = e.class {
        l = l.class(c);
    }
    l.into()
}

/// What error number `errno` of a copy between the ranks' memory means (`i32::MAX`: a copy
/// that moved nothing).
fn describe_errno(errno: i32) -> String {
    match errno {
        i32::MAX => "a copy moved nothing".to_string(),
        e => std::io::Error::from_raw_os_error(e).to_string(),
    }
}

/// A communicator over one MPI communicator (`MPI_Comm`): the front end
/// ([`grid_core::Comm`]) over [`MpiBackend`]. Created by [`crate::MpiRuntime`] (the world,
/// named `"world"`) or by [`crate::MpiFactory`] (sub-groups). The MPI communicator is freed
/// (`MPI_Comm_free`) when this value is dropped.
///
/// Errors come back as [`Error`]s: the front end validates arguments before MPI sees them, and
/// MPI itself runs with `MPI_ERRORS_RETURN`, so its failures become [`Error::Library`] with
/// MPI's error code, class and message.
///
/// Ordering: as in MPI, collectives on one communicator must be called in the same order on
/// every member. Nonblocking operations ([`grid_core::Communicator::start`]) are MPI immediate
/// operations issued at the call, so they take their place in that order when they are
/// started, and blocking and nonblocking calls may be mixed.
///
/// ```no_run
/// use backend_mpi::MpiRuntime;
/// use grid_core::{Communicator, CommunicatorExt, ReduceOp};
/// let rt = MpiRuntime::init()?;
/// let world = rt.world();
/// let mut sum = [0i64];
/// world.all_reduce_into(&[world.rank() as i64][..], &mut sum[..], ReduceOp::Sum)?;
/// let mut v = [world.rank() as f32; 4];
/// world.all_reduce_in_place(&mut v[..], ReduceOp::Max)?; // MPI_IN_PLACE, no copy
/// # Ok::<(), grid_core::Error>(())
/// ```
pub type MpiCommunicator = Comm<MpiBackend>;

/// The MPI backend of one communicator: executes operations that the front end validated.
/// Reached from an [`MpiCommunicator`] through `Deref` (`comm.finish()`) or `comm.inner()`.
#[derive(Debug)]
pub struct MpiBackend {
    raw: raw::Comm,
    /// A duplicate of `raw` (same members) that carries only the mismatch check's exchanges
    /// ([`Backend::run_check`]), so that they never meet a real operation of a rank that does
    /// not check.
    check: raw::Comm,
    rank: usize,
    size: usize,
    global: Vec<usize>,
    name: String,
    finished: AtomicBool,
    /// The configured default time limit ([`crate::MpiConfig::timeout`]).
    timeout: TimeLimit,
    /// The blocking collective in flight and the abort flag (see the `watch` module).
    watch: Arc<Watch>,
    /// The scratch blocks of the ring all-reduce and reduce-scatter (`ring` module), kept
    /// between calls.
    ring_scratch: ring::Scratch,
    /// [`DIRECT_MAX`] or [`crate::DIRECT_MAX_ENV`].
    direct_max: usize,
    /// [`ROUND_MAX`] or [`crate::ROUND_MAX_ENV`].
    round_max: usize,
    /// The memory of the rounds, kept between calls: the received messages and grid-core's
    /// round scratch (outgoing messages, decoded payloads). A round that finds it in use, which
    /// concurrent collectives on one communicator would be, allocates its own.
    round_scratch: std::sync::Mutex<round::Memory>,
    /// [`crate::PEER_READ_MIN`] or [`crate::PEER_READ_MIN_ENV`] (0: never).
    peer_read_min: usize,
    /// Set on every rank alike once a copy between the ranks' memory failed (module
    /// `peer_read`): the all-gathers, broadcasts and all-reduces of this communicator keep to
    /// MPI's calls from then on.
    peer_read_off: AtomicBool,
    /// Set on every rank alike once an in-place reduction found that every rank can read
    /// every other's memory (`peer_read::reduce`'s probe, needed once).
    peer_read_probed: AtomicBool,
    /// How many collectives copied straight between the ranks' memory
    /// ([`MpiBackend::peer_reads`]).
    peer_reads: std::sync::atomic::AtomicU64,
}

impl MpiBackend {
    /// Wraps a new MPI communicator (collective over its members: it is duplicated once for
    /// the mismatch check).
    pub(crate) fn from_raw(
        raw: raw::Comm,
        op: &'static str,
        name: String,
        timeout: TimeLimit,
    ) -> Result<MpiCommunicator> {
        let rank = raw.rank().map_err(|e| backend_err(op, &name, e))?;
        let size = raw.size().map_err(|e| backend_err(op, &name, e))?;
        let global = raw.world_ranks().map_err(|e| backend_err(op, &name, e))?;
        let direct_max = crate::config::env_usize(crate::DIRECT_MAX_ENV, DIRECT_MAX, 1 << 20)?;
        let round_max = crate::config::env_usize(crate::ROUND_MAX_ENV, ROUND_MAX, 1 << 20)?;
        let peer_read_min =
            crate::config::env_usize(crate::PEER_READ_MIN_ENV, crate::PEER_READ_MIN, 1 << 40)?;
        crate::config::stage_copies()?;
        let check = raw.dup().map_err(|e| backend_err(op, &name, e))?;
        tracing::debug!(op, comm = %name, rank, size, ?global, "mpi communicator created");
        let watch = Watch::new(Site {
            comm: name.clone(),
            ranks: global.clone(),
            world_rank: global.get(rank).copied().unwrap_or(rank),
        });
        let backend = MpiBackend {
            raw,
            check,
            rank,
            size,
            global,
            name: name.clone(),
            finished: AtomicBool::new(false),
            timeout,
            watch,
            ring_scratch: std::sync::Mutex::new([None, None]),
            direct_max,
            round_max,
            round_scratch: std::sync::Mutex::new(round::Memory::default()),
            peer_read_min,
            peer_read_off: AtomicBool::new(false),
            peer_read_probed: AtomicBool::new(false),
            peer_reads: std::sync::atomic::AtomicU64::new(0),
        };
        Ok(Comm::new(backend, name))
    }

    /// The default time limit this communicator was created with ([`crate::MpiConfig`]);
    /// sub-communicators created from it by [`crate::MpiFactory`] get the same.
    pub fn configured_timeout(&self) -> TimeLimit {
        self.timeout
    }

    /// Marks the creation of a sub-communicator from this one in flight (watched like a
    /// blocking collective, under this communicator's current default time limit).
    pub(crate) fn creating(&self, op: usize, limit: TimeLimit) -> watch::InFlight<'_> {
        self.watch.enter_creation(op, limit)
    }

    /// Ends the job for an operation that cannot be given up (see the `watch` module).
    #[cold]
    fn stuck(&self, op: &'static str, seq: u64, limit: TimeLimit, why: Stop) -> Infallible {
        watch::end_job(&Ending {
            what: format!("{op} #{seq}"),
            limit,
            why,
            site: &self.watch.site,
        })
    }

    pub(crate) fn raw(&self) -> &raw::Comm {
        &self.raw
    }

    pub(crate) fn err(&self, op: &'static str, e: RawError) -> Error {
        backend_err(op, &self.name, e)
    }

    /// Marks the communicator finished: every later call returns [`Error::Finalized`]. Local,
    /// not collective. The MPI communicator itself is freed when the value is dropped.
    /// Operations already started complete normally.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// use grid_core::Communicator;
    /// let f = backend_mpi::MpiFactory::new();
    /// # use grid_core::GroupFactory;
    /// let sub = f.split(rt.world(), Some(0), rt.world().rank())?.expect("every rank is a member");
    /// sub.finish();
    /// assert!(sub.barrier().is_err());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// True after [`MpiBackend::finish`] or after MPI was finalized.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// assert!(!rt.world().is_finished());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire) || raw::FINALIZED.load(Ordering::Acquire)
    }

    /// All-reduce through a wider wire type (halves via f32, integer averages via i64); kept
    /// out of line so the common path stays small. `send = None`: in place on `recv`.
    #[cold]
    #[inline(never)]
    fn all_reduce_staged(
        &self,
        c: &raw::Comm,
        send: Option<HostSlice<'_>>,
        recv: HostSliceMut<'_>,
        plan: Plan,
    ) -> Result<()> {
        let input = send.unwrap_or(recv.as_slice());
        let w = plan.wire.unwrap_or(input.dtype());
        // MPI has no type for these: the conversion to the wire type is the staging, and the
        // wire buffer is reduced in place.
        let mut wide = stage::widen(input, w);
        self.reduce_in_place(c, wide.as_mut_slice(), plan.op, None)?;
        stage::narrow(wide.as_slice(), recv, plan.divide);
        Ok(())
    }

    /// `MPI_IN_PLACE` all-reduce; libraries whose `MPI_IN_PLACE` is unknown go through one
    /// copy of the input. From [`crate::PEER_READ_MIN`] bytes the ranks of one node copy
    /// straight between their memory instead (`peer_read::reduce`), and large ones that
    /// do not qualify for that run as the `ring` module's ring on the duplicate communicator
    /// (see there why).
    fn reduce_in_place(
        &self,
        c: &raw::Comm,
        mut buf: HostSliceMut<'_>,
        r: raw::Reduce,
        pre: Option<&[u64]>,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        if self.reduce_by_reads(Reduction::AllReduce, (None, buf.reborrow()), r, pre)? {
            return Ok(());
        }
        if ring::applies(buf.dtype(), buf.len(), self.size) {
            return self.ring_all_reduce(buf, r);
        }
        if raw::in_place_supported() {
            return c.all_reduce_in_place(buf, r).map_err(|e| self.err(OP, e));
        }
        let send = buf.as_slice().to_owned_buffer();
        c.all_reduce(send.as_slice(), buf.reborrow(), r)
            .map_err(|e| self.err(OP, e))
    }

    /// The `ring` module's all-reduce of `buf` in place, on the duplicate communicator.
    fn ring_all_reduce(&self, buf: HostSliceMut<'_>, r: raw::Reduce) -> Result<()> {
        let me = (self.rank, self.size);
        ring::all_reduce(&self.check, buf, r, me, &self.ring_scratch)
            .map_err(|e| self.ring_err("all_reduce", e))
    }

    /// The error of a ring (`ring` module) in operation `op`.
    #[cold]
    fn ring_err(&self, op: &'static str, e: ring::RingError) -> Error {
        match e {
            ring::RingError::Mpi(e) => self.err(op, e),
            ring::RingError::Other(e) => e,
        }
    }

    /// How many blocking all-gathers, broadcasts and all-reduces (in place or not) of this
    /// communicator copied straight between the ranks' memory instead of calling
    /// `MPI_Allgather`, `MPI_Bcast` or `MPI_Allreduce` (every rank on one node, buffers of at
    /// least [`crate::PEER_READ_MIN`] bytes whose part the others copy through is at most
    /// [`crate::PEER_READ_PLAIN_MAX`] bytes or mostly on huge pages; see docs/backends.md). The
    /// same on every rank.
    pub fn peer_reads(&self) -> u64 {
        self.peer_reads.load(Ordering::Relaxed)
    }

    /// Whether this communicator has more ranks than this node has online processors: if its
    /// ranks are all on this node (the only case where they copy between their memory), it is
    /// crowded, and its in-place all-reduces below [`crate::PEER_READ_CROWDED_IN_PLACE_MIN`]
    /// keep to MPI's path (docs/backends.md).
    pub fn crowded(&self) -> bool {
        peer_read::crowded(self.size)
    }

    /// Whether this communicator still tries to copy straight between the ranks' memory in
    /// all-gathers, broadcasts and all-reduces ([`MpiBackend::peer_reads`]): false when
    /// [`crate::PEER_READ_MIN_ENV`] is 0, on one rank, or after a copy failed (a kernel or
    /// seccomp profile that forbids `process_vm_readv`), on every rank alike.
    pub fn reads_peers_when_it_pays(&self) -> bool {
        self.size > 1 && self.peer_read_min > 0 && !self.peer_read_off.load(Ordering::Relaxed)
    }

    /// Whether a collective whose buffer (a reduction's: its input) is `input` tries the direct
    /// copies at all; the one test of [`Self::read_peers`] and [`Self::peer_row`].
    fn may_read_peers(&self, input: HostSlice<'_>) -> bool {
        let bytes = input.len().saturating_mul(input.dtype().size_bytes());
        bytes >= self.peer_read_min && self.reads_peers_when_it_pays()
    }

    /// [`Self::may_read_peers`] for a reduction: also only for the types reduced on the host;
    /// the one test of [`Self::reduce_by_reads`] and [`Self::peer_row`].
    fn may_reduce_by_reads(&self, input: HostSlice<'_>) -> bool {
        self.may_read_peers(input) && ring::reduces_on_host(input.dtype())
    }

    /// Runs blocking collective `reads` on `buf` by copying straight between the ranks' memory
    /// (module `peer_read`) when it pays: true when done, false when the caller runs the MPI
    /// call (the source parts untouched). Whether to try is decided from what is the same on every
    /// rank of a well-formed call (the mismatch check makes sure of it from 2 KiB on).
    fn read_peers(
        &self,
        op: &'static str,
        reads: Reads,
        (send, buf): (Option<HostSlice<'_>>, HostSliceMut<'_>),
        pre: Option<&[u64]>,
    ) -> Result<bool> {
        if !self.may_read_peers(buf.as_slice()) {
            return Ok(false);
        }
        let me = (self.rank, self.size);
        let outcome = peer_read::run(&self.check, me, reads, (send, buf), pre)
            .map_err(|e| self.err(op, e))?;
        self.took(op, outcome)
    }

    /// Reduction `what` with `r` of `send` (or of `buf` in place) into `buf` by copying straight
    /// between the ranks' memory (`peer_read::reduce`) when it pays, as [`Self::read_peers`]:
    /// true when done, false when the caller runs its own path on the untouched input.
    fn reduce_by_reads(
        &self,
        what: Reduction,
        (send, buf): (Option<HostSlice<'_>>, HostSliceMut<'_>),
        r: raw::Reduce,
        pre: Option<&[u64]>,
    ) -> Result<bool> {
        if !self.may_reduce_by_reads(send.unwrap_or(buf.as_slice())) {
            return Ok(false);
        }
        let op = match what {
            Reduction::AllReduce => "all_reduce",
            Reduction::ReduceScatter => "reduce_scatter",
        };
        let me = (self.rank, self.size);
        let probe = !self.peer_read_probed.load(Ordering::Relaxed);
        let in_place = send.is_none();
        let outcome = peer_read::reduce(
            &self.check,
            me,
            (what, probe),
            (send, buf),
            (r, pre),
            &self.ring_scratch,
        )
        .map_err(|e| self.err(op, e))?;
        if in_place && outcome == Outcome::Done {
            self.peer_read_probed.store(true, Ordering::Relaxed);
        }
        self.took(op, outcome)
    }

    /// Whether the direct copies completed collective `op` (counted), stopping them on this
    /// communicator after a failure; the error of a failure that left no result.
    fn took(&self, op: &'static str, outcome: Outcome) -> Result<bool> {
        match outcome {
            Outcome::Done => {
                self.peer_reads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Outcome::NotTaken => Ok(false),
            Outcome::Failed(errno) => {
                self.stop_reading_peers(errno);
                Ok(false)
            }
            Outcome::Recovered(errno) => {
                self.stop_reading_peers(errno);
                Ok(true)
            }
            Outcome::Broken(errno) => {
                self.stop_reading_peers(errno);
                Err(self.err(
                    op,
                    RawError::msg(format!(
                        "copying between the ranks' memory (process_vm_readv) failed on some \
                         rank after its buffer had changed ({}); no rank's buffer holds the \
                         result",
                        describe_errno(errno)
                    )),
                ))
            }
        }
    }

    /// Stops the direct copies on this communicator after one failed (`errno`: the largest
    /// error number any rank met); every rank calls it for the same collective.
    #[cold]
    fn stop_reading_peers(&self, errno: i32) {
        self.peer_read_off.store(true, Ordering::Relaxed);
        let why = describe_errno(errno);
        tracing::warn!(
            comm = %self.name,
            errno,
            %why,
            "copying between the ranks' memory (process_vm_readv/writev) failed; all-gathers \
             broadcasts and all-reduces of this communicator use MPI's calls from now on"
        );
    }

    /// `MPI_IN_PLACE` all-gather of `buf` (`size · k` elements, this rank's block at
    /// `rank · k`); libraries whose `MPI_IN_PLACE` is unknown go through one copy of this
    /// rank's block.
    fn gather_in_place(&self, c: &raw::Comm, mut buf: HostSliceMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        if raw::in_place_supported() {
            return c.all_gather_in_place(buf).map_err(|e| self.err(OP, e));
        }
        let k = buf.len() / self.size.max(1);
        let mine = block_of(OP, buf.as_slice(), self.rank * k, k)?.to_owned_buffer();
        c.all_gather(mine.as_slice(), buf.reborrow())
            .map_err(|e| self.err(OP, e))
    }

    /// `MPI_IN_PLACE` reduce-scatter of `buf` (`size · k` elements of the wire type, `k` of
    /// them per rank), leaving the reduced block where MPI puts it: at the **start** of `buf`.
    /// Returns that offset (0); libraries whose `MPI_IN_PLACE` is unknown reduce a copy of the
    /// input into `rank · k`, which is returned instead.
    fn scatter_in_place(
        &self,
        c: &raw::Comm,
        mut buf: HostSliceMut<'_>,
        r: raw::Reduce,
    ) -> Result<usize> {
        const OP: &str = "reduce_scatter";
        if raw::in_place_supported() {
            c.reduce_scatter_in_place(buf, r)
                .map_err(|e| self.err(OP, e))?;
            return Ok(0);
        }
        let k = buf.len() / self.size.max(1);
        let at = self.rank * k;
        let send = buf.as_slice().to_owned_buffer();
        let recv = block_mut(OP, &mut buf, at, k)?;
        c.reduce_scatter(send.as_slice(), recv, r)
            .map_err(|e| self.err(OP, e))?;
        Ok(at)
    }

    /// Whether this communicator's checks travel as rounds of messages: from 2 ranks up to
    /// [`DIRECT_MAX`] ([`crate::DIRECT_MAX_ENV`]).
    fn rounds(&self) -> bool {
        self.size >= 2 && self.size <= self.direct_max
    }

    /// The largest payload of a round's message for `op`: [`ROUND_MAX`]
    /// ([`crate::ROUND_MAX_ENV`]), at most [`PAIR_ROUND_MAX`] at 2 ranks but for a broadcast
    /// (there only the root sends data, one message, where the check alone and `MPI_Bcast`
    /// take two exchanges). The same on every rank (the settings must be).
    fn round_limit(&self, op: &Op<'_>) -> usize {
        if self.size == 2 && !matches!(op, Op::Broadcast { .. }) {
            self.round_max.min(PAIR_ROUND_MAX)
        } else {
            self.round_max
        }
    }

    /// Runs blocking collective `v` after its mismatch check `check`: as one round of messages
    /// that carries both ([`ROUND_MAX`], [`DIRECT_MAX`]) where it fits, otherwise the check
    /// alone ([`MpiBackend::check_alone`]) and then the MPI call.
    fn run_checked(&self, check: &DeferredCheck, v: Validated<Op<'_>>) -> Result<()> {
        let (seq, limit) = (v.seq(), v.time_limit());
        let fits = self.rounds()
            && check.fingerprints_suffice()
            && round_payload(v.op(), self.size).is_some_and(|b| b <= self.round_limit(v.op()));
        if !fits {
            // A collective that may copy straight between the ranks' memory sends the first
            // exchange of those copies (each rank's row) in the check's round.
            let pre = match self.peer_row(v.op()) {
                Some(row) if self.rounds() && check.fingerprints_suffice() => {
                    Some(self.check_carrying(check, (seq, limit), &row)?)
                }
                _ => {
                    self.check_alone(check, seq, limit)?;
                    None
                }
            };
            return self.exec(&self.raw, false, v, pre.as_deref());
        }
        let c = round_form(v.into_op())?;
        self.round(check, c, false, seq, limit)
    }

    /// The mismatch check of collective #`seq` by itself: its fingerprint in one round of
    /// messages (up to [`DIRECT_MAX`] ranks; so that it meets the rounds of ranks whose
    /// collective carries its data in the round), then, where fingerprints do not decide it
    /// (an all-to-all-v's counts) or above [`DIRECT_MAX`] ranks, the check's exchanges on the
    /// duplicate communicator.
    fn check_alone(&self, check: &DeferredCheck, seq: u64, limit: TimeLimit) -> Result<()> {
        if self.rounds() {
            self.round(check, RoundOp::Barrier, true, seq, limit)?;
            if check.fingerprints_suffice() {
                return Ok(());
            }
        }
        check.verify_with(seq, limit, &mut |v| self.exec(&self.check, true, v, None))
    }

    /// The mismatch check of collective #`seq` as one round of messages that also carries
    /// `row`, this rank's row of the first exchange of the direct copies (`peer_read`): every
    /// rank's row, in rank order, once the fingerprints agree (a mismatch is the same error as
    /// [`Self::check_alone`]'s).
    fn check_carrying(
        &self,
        check: &DeferredCheck,
        (seq, limit): (u64, TimeLimit),
        row: &[u64; peer_read::FIELDS],
    ) -> Result<Vec<u64>> {
        let mut rows = vec![0u64; peer_read::FIELDS * self.size];
        let c = RoundOp::AllGather {
            send: Some(HostSlice::U64(row)),
            recv: HostSliceMut::U64(&mut rows),
        };
        self.round(check, c, true, seq, limit)?;
        Ok(rows)
    }

    /// This rank's row of the direct copies' first exchange for `op` (`peer_read::full_row`),
    /// when `exec` will try them: the same conditions as [`Self::read_peers`] and
    /// [`Self::reduce_by_reads`], decided alike on every rank of a well-formed call. `None` for
    /// every other operation, and for the reductions that go through a wider type.
    fn peer_row(&self, op: &Op<'_>) -> Option<[u64; peer_read::FIELDS]> {
        fn view<'b>(b: &'b BufRef<'_>) -> Option<HostSlice<'b>> {
            match b {
                BufRef::Host(h) => Some(*h),
                BufRef::Device(_) => None,
            }
        }
        fn view_mut<'b>(b: &'b BufMut<'_>) -> Option<HostSlice<'b>> {
            match b {
                BufMut::Host(h) => Some(h.as_slice()),
                BufMut::Device(_) => None,
            }
        }
        let me = (self.rank, self.size);
        let crowded = peer_read::crowded(self.size);
        // A reduction's row, when it reduces in its own type (`exec` stages the others).
        let reduction = |what, send: Option<HostSlice<'_>>, buf: HostSlice<'_>, op| {
            let plan = stage::plan(buf.dtype(), op, self.size);
            (plan.wire.is_none() && self.may_reduce_by_reads(send.unwrap_or(buf)))
                .then(|| peer_read::reduce_row(what, (self.size, crowded), (send, buf), plan.op))
        };
        let reads = |reads, send: Option<HostSlice<'_>>, buf: HostSlice<'_>| {
            self.may_read_peers(buf)
                .then(|| peer_read::reads_row(reads, me, send, buf))
        };
        let row = match op {
            Op::AllGather { send, recv } => {
                reads(Reads::AllGather, Some(view(send)?), view_mut(recv)?)
            }
            Op::AllGatherInPlace { buf } => reads(Reads::AllGatherInPlace, None, view_mut(buf)?),
            Op::Broadcast { buf, root } => {
                reads(Reads::Broadcast { root: *root }, None, view_mut(buf)?)
            }
            Op::AllReduce { send, recv, op } => reduction(
                Reduction::AllReduce,
                Some(view(send)?),
                view_mut(recv)?,
                *op,
            ),
            Op::AllReduceInPlace { buf, op } => {
                reduction(Reduction::AllReduce, None, view_mut(buf)?, *op)
            }
            Op::ReduceScatter { send, recv, op } => reduction(
                Reduction::ReduceScatter,
                Some(view(send)?),
                view_mut(recv)?,
                *op,
            ),
            Op::ReduceScatterInPlace { buf, op } => {
                reduction(Reduction::ReduceScatter, None, view_mut(buf)?, *op)
            }
            _ => None,
        }?;
        Some(peer_read::full_row(row))
    }

    /// One round of messages on the duplicate communicator (grid-core's `comm::round`), every
    /// message `[fingerprint | payload]`: the same [`Error::CollectiveMismatch`] on every rank
    /// when the fingerprints differ (nothing written to the caller's memory), otherwise `c`'s
    /// result. Failures are those of the checked operation. The round is watched like a
    /// blocking collective (`alone`: as the check's exchange before it), so its time limit and
    /// a job's end name it the same way.
    fn round(
        &self,
        check: &DeferredCheck,
        c: RoundOp<'_>,
        alone: bool,
        seq: u64,
        limit: TimeLimit,
    ) -> Result<()> {
        let op = check.op();
        let _w = self.watch.enter(watch::op_index(op), seq, alone, limit);
        let (me, n) = (self.rank, self.size);
        let mut cached = self.round_scratch.try_lock().ok();
        let mut fresh = round::Memory::default();
        // `received`: one room per peer, of a fingerprint and the largest payload.
        let round::Memory {
            received: recv,
            scratch,
        } = cached.as_deref_mut().unwrap_or(&mut fresh);
        let out = scratch.outgoing(&c, Some(check), me, n)?;
        let from = (0..n).filter(|&j| j != me);
        // Room for the longest message any rank sends in a round (the same settings on every
        // rank): a fingerprint and at most `round_max` bytes of data (`round_limit` of any
        // operation), so that no well-formed message is truncated whatever operations and
        // counts the ranks pass.
        let capacity = FP_BYTES + self.round_max;
        if recv.len() < capacity * (n - 1) {
            recv.resize(capacity * (n - 1), 0);
        }
        // The received lengths, in rank order without this rank.
        let lens = {
            let mut rooms: Vec<HostSliceMut<'_>> = recv
                .chunks_exact_mut(capacity)
                .take(n - 1)
                .map(HostSliceMut::U8)
                .collect();
            // Receives first: an eager message then lands in place, not in Open MPI's buffer of
            // unexpected messages.
            let mut ops: Vec<P2p<'_, '_>> = Vec::with_capacity(2 * (n - 1));
            for (peer, buf) in from.clone().zip(rooms.iter_mut()) {
                ops.push(P2p::Recv {
                    buf,
                    peer,
                    tag: ROUND_TAG,
                });
            }
            for m in &out.messages {
                ops.push(P2p::Send {
                    buf: HostSlice::U8(&out.bytes[m.offset..m.offset + m.len]),
                    peer: m.peer,
                    tag: ROUND_TAG,
                });
            }
            let stuck = |why| self.stuck(op, seq, limit, why);
            // No limit here: the watch ends the job at the limit, as for the MPI calls.
            self.check
                .batch_within(&mut ops, None, &self.watch.aborted, &stuck)
                .map_err(|e| self.err(op, e))?
                .map_err(|why| self.stopped(op, limit, None, why))?
        };
        let message = |j: usize| {
            let i = if j < me { j } else { j - 1 };
            &recv[i * capacity..i * capacity + lens[i]]
        };
        round::verify_fingerprints(check, me, n, &message)?;
        // The fingerprints agree, so every message has the length this rank expects, unless
        // the peer runs the collective in another form or another version of this library.
        for j in from {
            let (want, sent) = (c.expected(j, n, FP_BYTES), message(j).len());
            if sent != want {
                return Err(Error::Invalid(format!(
                    "{op}: rank {j} sent {sent} bytes where {want} were expected, although every \
                     rank describes the same collective: rank {j} runs it in another form (a \
                     nonblocking call where this rank makes a blocking one, or the reverse) or \
                     runs another version of this library"
                )));
            }
        }
        scratch.finish(c, me, n, &|j| &message(j)[FP_BYTES..])
    }

    /// The error of an operation this rank gave up (a cancelled receive).
    #[cold]
    fn stopped(&self, op: &'static str, limit: TimeLimit, peer: Option<usize>, why: Stop) -> Error {
        stopped(op, limit, peer, why)
    }

    /// Runs a validated blocking operation on `c` (this communicator, or its duplicate for the
    /// mismatch check's exchanges, `check`). Collectives are the blocking MPI calls, watched by
    /// the watchdog; point-to-point operations complete on this thread under the limit.
    fn exec(
        &self,
        c: &raw::Comm,
        check: bool,
        v: Validated<Op<'_>>,
        pre: Option<&[u64]>,
    ) -> Result<()> {
        let (seq, limit) = (v.seq(), v.time_limit());
        let abort = &self.watch.aborted;
        let watch = |op: usize| self.watch.enter(op, seq, check, limit);
        match v.into_op() {
            Op::AllReduce { send, recv, op } => {
                const OP: &str = "all_reduce";
                let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let plan = stage::plan(send.dtype(), op, self.size);
                let _w = watch(watch::ALL_REDUCE);
                if plan.wire.is_some() {
                    return self.all_reduce_staged(c, Some(send), recv, plan);
                }
                if self.reduce_by_reads(
                    Reduction::AllReduce,
                    (Some(send), recv.reborrow()),
                    plan.op,
                    pre,
                )? {
                    // Done by copies between the ranks' memory.
                } else if ring::applies(send.dtype(), send.len(), self.size) {
                    // The ring works in place: one copy of the input first.
                    recv.copy_from(send)?;
                    self.ring_all_reduce(recv.reborrow(), plan.op)?;
                } else {
                    c.all_reduce(send, recv.reborrow(), plan.op)
                        .map_err(|e| self.err(OP, e))?;
                }
                if let Some(n) = plan.divide {
                    grid_core::kernels::divide(recv, n);
                }
                Ok(())
            }
            Op::AllReduceInPlace { buf, op } => {
                const OP: &str = "all_reduce";
                let mut buf = host_mut(OP, buf)?;
                let plan = stage::plan(buf.dtype(), op, self.size);
                let _w = watch(watch::ALL_REDUCE);
                if plan.wire.is_some() {
                    return self.all_reduce_staged(c, None, buf, plan);
                }
                self.reduce_in_place(c, buf.reborrow(), plan.op, pre)?;
                if let Some(n) = plan.divide {
                    grid_core::kernels::divide(buf, n);
                }
                Ok(())
            }
            Op::Broadcast { buf, root } => {
                const OP: &str = "broadcast";
                let mut buf = host_mut(OP, buf)?;
                let _w = watch(watch::BROADCAST);
                if self.read_peers(OP, Reads::Broadcast { root }, (None, buf.reborrow()), pre)? {
                    return Ok(());
                }
                c.broadcast(buf, root).map_err(|e| self.err(OP, e))
            }
            Op::AllGather { send, recv } => {
                const OP: &str = "all_gather";
                let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let _w = watch(watch::ALL_GATHER);
                if self.read_peers(OP, Reads::AllGather, (Some(send), recv.reborrow()), pre)? {
                    return Ok(());
                }
                c.all_gather(send, recv).map_err(|e| self.err(OP, e))
            }
            Op::ReduceScatter { send, recv, op } => {
                const OP: &str = "reduce_scatter";
                let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let plan = stage::plan(send.dtype(), op, self.size);
                let _w = watch(watch::REDUCE_SCATTER);
                match plan.wire {
                    None if self.reduce_by_reads(
                        Reduction::ReduceScatter,
                        (Some(send), recv.reborrow()),
                        plan.op,
                        pre,
                    )? =>
                    {
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(recv, n);
                        }
                    }
                    None if ring::applies_to_reduce_scatter(
                        send.dtype(),
                        send.len(),
                        self.size,
                    ) =>
                    {
                        let me = (self.rank, self.size);
                        ring::reduce_scatter(
                            &self.check,
                            send,
                            recv.reborrow(),
                            plan.op,
                            me,
                            &self.ring_scratch,
                        )
                        .map_err(|e| self.ring_err(OP, e))?;
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(recv, n);
                        }
                    }
                    None => {
                        c.reduce_scatter(send, recv.reborrow(), plan.op)
                            .map_err(|e| self.err(OP, e))?;
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(recv, n);
                        }
                    }
                    Some(w) => {
                        let s = stage::widen(send, w);
                        let mut r = HostBuffer::zeros(w, recv.len() * plan.parts);
                        c.reduce_scatter(s.as_slice(), r.as_mut_slice(), plan.op)
                            .map_err(|e| self.err(OP, e))?;
                        stage::narrow(r.as_slice(), recv, plan.divide);
                    }
                }
                Ok(())
            }
            Op::AllGatherInPlace { buf } => {
                let mut buf = host_mut("all_gather", buf)?;
                let _w = watch(watch::ALL_GATHER);
                let whole = (None, buf.reborrow());
                if self.read_peers("all_gather", Reads::AllGatherInPlace, whole, pre)? {
                    return Ok(());
                }
                self.gather_in_place(c, buf)
            }
            Op::ReduceScatterInPlace { buf, op } => {
                // MPI leaves the reduced block at the start of the buffer; the convention here
                // (NCCL's) is rank · k: one copy_within of k elements moves it there.
                const OP: &str = "reduce_scatter";
                let mut buf = host_mut(OP, buf)?;
                let k = buf.len() / self.size.max(1);
                let at = self.rank * k;
                let plan = stage::plan(buf.dtype(), op, self.size);
                let _w = watch(watch::REDUCE_SCATTER);
                match plan.wire {
                    None if self.reduce_by_reads(
                        Reduction::ReduceScatter,
                        (None, buf.reborrow()),
                        plan.op,
                        pre,
                    )? =>
                    {
                        // The block ends where it lies: no copy.
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(block_mut(OP, &mut buf, at, k)?, n);
                        }
                    }
                    None if ring::applies_to_reduce_scatter(buf.dtype(), buf.len(), self.size) => {
                        // The block ends where it lies: no copy.
                        let me = (self.rank, self.size);
                        ring::reduce_scatter_in_place(
                            &self.check,
                            buf.reborrow(),
                            plan.op,
                            me,
                            &self.ring_scratch,
                        )
                        .map_err(|e| self.ring_err(OP, e))?;
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(block_mut(OP, &mut buf, at, k)?, n);
                        }
                    }
                    None => {
                        let from = self.scatter_in_place(c, buf.reborrow(), plan.op)?;
                        if from != at {
                            buf.copy_within(from, k, at)?;
                        }
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(block_mut(OP, &mut buf, at, k)?, n);
                        }
                    }
                    Some(w) => {
                        // The conversion to the wire type is the staging; the wire buffer is
                        // reduce-scattered in place and its block narrowed into rank · k.
                        let mut wide = stage::widen(buf.as_slice(), w);
                        let from = self.scatter_in_place(c, wide.as_mut_slice(), plan.op)?;
                        let src = block_of(OP, wide.as_slice(), from, k * plan.parts)?;
                        stage::narrow(src, block_mut(OP, &mut buf, at, k)?, plan.divide);
                    }
                }
                Ok(())
            }
            Op::AllToAll { send, recv } => {
                const OP: &str = "all_to_all";
                let (send, recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let _w = watch(watch::ALL_TO_ALL);
                c.all_to_all(send, recv).map_err(|e| self.err(OP, e))
            }
            Op::Barrier => {
                let _w = watch(watch::BARRIER);
                c.barrier().map_err(|e| self.err("barrier", e))
            }
            Op::Send { buf, peer, tag } => {
                const OP: &str = "send";
                let buf = host(OP, buf)?;
                let stuck = |why| self.stuck(OP, seq, limit, why);
                c.send_within(buf, peer, tag, limit.duration(), abort, &stuck)
                    .map_err(|e| self.err(OP, e))
            }
            Op::Recv { buf, peer, tag } => {
                const OP: &str = "recv";
                let buf = host_mut(OP, buf)?;
                let expected = buf.len();
                let stuck = |why| self.stuck(OP, seq, limit, why);
                let got = c
                    .recv_within(buf, peer, tag, limit.duration(), abort, &stuck)
                    .map_err(|e| self.err(OP, e))?
                    .map_err(|why| self.stopped(OP, limit, Some(peer), why))?;
                grid_core::comm::check::len(OP, "received message", expected, got)
            }
            Op::Batch(ops) => {
                const OP: &str = "batch_p2p";
                let mut sends = Vec::new();
                let mut recvs = Vec::new();
                for op in ops {
                    match op {
                        P2pOp::Send { buf, peer, tag } => sends.push((host(OP, buf)?, peer, tag)),
                        P2pOp::Recv { buf, peer, tag } => {
                            recvs.push((host_mut(OP, buf)?, peer, tag))
                        }
                        P2pOp::SendFramed { .. } | P2pOp::RecvFramed { .. } => {
                            return Err(P2pOp::not_lowered(BACKEND));
                        }
                    }
                }
                let mut raw_ops: Vec<P2p<'_, '_>> = Vec::with_capacity(sends.len() + recvs.len());
                // Receives first: posting them early lets matching sends complete eagerly.
                for (buf, peer, tag) in recvs.iter_mut() {
                    raw_ops.push(P2p::Recv {
                        buf,
                        peer: *peer,
                        tag: *tag,
                    });
                }
                for (buf, peer, tag) in sends {
                    raw_ops.push(P2p::Send { buf, peer, tag });
                }
                let stuck = |why| self.stuck(OP, seq, limit, why);
                c.batch_within(&mut raw_ops, limit.duration(), abort, &stuck)
                    .map_err(|e| self.err(OP, e))?
                    .map(drop)
                    .map_err(|why| self.stopped(OP, limit, None, why))
            }
            Op::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                const OP: &str = "all_to_all_v";
                let (send, recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let _w = watch(watch::ALL_TO_ALL_V);
                c.all_to_all_v(send, send_counts, recv, recv_counts)
                    .map_err(|e| self.err(OP, e))
            }
            Op::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                const OP: &str = "all_gather_v";
                let (send, recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let _w = watch(watch::ALL_GATHER_V);
                c.all_gather_v(send, recv, recv_counts)
                    .map_err(|e| self.err(OP, e))
            }
            Op::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                const OP: &str = "reduce_scatter_v";
                let (send, mut recv) = (host(OP, send)?, host_mut(OP, recv)?);
                let plan = stage::plan(send.dtype(), op, self.size);
                let _w = watch(watch::REDUCE_SCATTER_V);
                match plan.wire {
                    None => {
                        c.reduce_scatter_v(send, send_counts, recv.reborrow(), plan.op)
                            .map_err(|e| self.err(OP, e))?;
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(recv, n);
                        }
                    }
                    Some(w) => {
                        let s = stage::widen(send, w);
                        let mut r = HostBuffer::zeros(w, recv.len() * plan.parts);
                        let counts: Vec<usize> =
                            send_counts.iter().map(|&n| n * plan.parts).collect();
                        c.reduce_scatter_v(s.as_slice(), &counts, r.as_mut_slice(), plan.op)
                            .map_err(|e| self.err(OP, e))?;
                        stage::narrow(r.as_slice(), recv, plan.divide);
                    }
                }
                Ok(())
            }
            Op::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                const OP: &str = "reduce";
                let send = host(OP, send)?;
                let mut recv = recv.map(|r| host_mut(OP, r)).transpose()?;
                let plan = stage::plan(send.dtype(), op, self.size);
                let _w = watch(watch::REDUCE);
                match plan.wire {
                    None => {
                        c.reduce(send, recv.as_mut().map(|r| r.reborrow()), plan.op, root)
                            .map_err(|e| self.err(OP, e))?;
                        if let (Some(n), Some(r)) = (plan.divide, recv) {
                            grid_core::kernels::divide(r, n);
                        }
                    }
                    Some(w) => {
                        let s = stage::widen(send, w);
                        let mut wide = recv
                            .as_ref()
                            .map(|r| HostBuffer::zeros(w, r.len() * plan.parts));
                        c.reduce(
                            s.as_slice(),
                            wide.as_mut().map(|b| b.as_mut_slice()),
                            plan.op,
                            root,
                        )
                        .map_err(|e| self.err(OP, e))?;
                        if let (Some(wide), Some(r)) = (wide, recv) {
                            stage::narrow(wide.as_slice(), r, plan.divide);
                        }
                    }
                }
                Ok(())
            }
            Op::Gather { send, recv, root } => {
                const OP: &str = "gather";
                let send = host(OP, send)?;
                let recv = recv.map(|r| host_mut(OP, r)).transpose()?;
                let _w = watch(watch::GATHER);
                c.gather(send, recv, root).map_err(|e| self.err(OP, e))
            }
            Op::Scatter { send, recv, root } => {
                const OP: &str = "scatter";
                let send = send.map(|s| host(OP, s)).transpose()?;
                let recv = host_mut(OP, recv)?;
                let _w = watch(watch::SCATTER);
                c.scatter(send, recv, root).map_err(|e| self.err(OP, e))
            }
        }
    }
}

/// The error of an operation given up on this rank: [`Error::Timeout`] or, after `abort()`,
/// [`Error::Aborted`].
fn stopped(op: &'static str, limit: TimeLimit, peer: Option<usize>, why: Stop) -> Error {
    match why {
        Stop::Timeout => Error::Timeout {
            op,
            millis: limit.as_millis(),
            peer,
            at: None,
        },
        Stop::Abort => Error::Aborted {
            op,
            reason: "abort() was called on this rank while the operation waited; it was cancelled"
                .into(),
            at: None,
        },
    }
}

/// Elements `at..at + k` of `s` (an internal error when out of bounds, which validation rules
/// out).
fn block_of<'a>(op: &'static str, s: HostSlice<'a>, at: usize, k: usize) -> Result<HostSlice<'a>> {
    s.sub(at, k)
        .ok_or_else(|| Error::Invalid(format!("{op}: internal: block {at}..+{k} out of bounds")))
}

/// Elements `at..at + k` of `s`, mutably (see [`block_of`]).
fn block_mut<'s>(
    op: &'static str,
    s: &'s mut HostSliceMut<'_>,
    at: usize,
    k: usize,
) -> Result<HostSliceMut<'s>> {
    let len = s.len();
    s.sub_mut(at, k).ok_or_else(|| {
        Error::Invalid(format!(
            "{op}: internal: block {at}..+{k} of {len} elements out of bounds"
        ))
    })
}

fn host<'a>(op: &'static str, b: BufRef<'a>) -> Result<HostSlice<'a>> {
    b.host_only(op, BACKEND)
}

fn host_mut<'a>(op: &'static str, b: BufMut<'a>) -> Result<HostSliceMut<'a>> {
    b.host_only(op, BACKEND)
}

fn owned(op: &'static str, t: Tensor) -> Result<HostBuffer> {
    t.host_only(op, BACKEND)
}

/// The largest payload (bytes) of a message of `op`'s one-round form over `n` ranks, or `None`
/// when it has none.
fn round_payload(op: &Op<'_>, n: usize) -> Option<usize> {
    let bytes = |len: usize, dtype: DType| len * dtype.size_bytes();
    Some(match op {
        Op::AllReduce { send, .. } => bytes(send.len(), send.dtype()),
        Op::AllReduceInPlace { buf, .. } | Op::Broadcast { buf, .. } => {
            bytes(buf.len(), buf.dtype())
        }
        Op::AllGather { send, .. } => bytes(send.len(), send.dtype()),
        Op::ReduceScatter { recv, .. } => bytes(recv.len(), recv.dtype()),
        Op::AllGatherInPlace { buf } | Op::ReduceScatterInPlace { buf, .. } => {
            bytes(buf.len() / n.max(1), buf.dtype())
        }
        Op::AllToAll { send, .. } => bytes(send.len() / n.max(1), send.dtype()),
        Op::Barrier => 0,
        _ => return None,
    })
}

/// `op` as its one-round form (only for operations [`round_payload`] accepts).
fn round_form(op: Op<'_>) -> Result<RoundOp<'_>> {
    let name = op.name();
    Ok(match op {
        Op::AllReduce { send, recv, op } => RoundOp::AllReduce {
            send: Some(host(name, send)?),
            recv: host_mut(name, recv)?,
            op,
        },
        Op::AllReduceInPlace { buf, op } => RoundOp::AllReduce {
            send: None,
            recv: host_mut(name, buf)?,
            op,
        },
        Op::Broadcast { buf, root } => RoundOp::Broadcast {
            buf: host_mut(name, buf)?,
            root,
        },
        Op::AllGather { send, recv } => RoundOp::AllGather {
            send: Some(host(name, send)?),
            recv: host_mut(name, recv)?,
        },
        Op::AllGatherInPlace { buf } => RoundOp::AllGather {
            send: None,
            recv: host_mut(name, buf)?,
        },
        Op::ReduceScatter { send, recv, op } => RoundOp::ReduceScatter {
            send: Some(host(name, send)?),
            recv: host_mut(name, recv)?,
            op,
        },
        Op::ReduceScatterInPlace { buf, op } => RoundOp::ReduceScatter {
            send: None,
            recv: host_mut(name, buf)?,
            op,
        },
        Op::AllToAll { send, recv } => RoundOp::AllToAll {
            send: host(name, send)?,
            recv: host_mut(name, recv)?,
        },
        Op::Barrier => RoundOp::Barrier,
        other => {
            return Err(Error::Invalid(format!(
                "internal: {} has no one-round form",
                other.name()
            )))
        }
    })
}

impl Backend for MpiBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global
    }
    fn accepts(&self, memory: Memory) -> bool {
        memory == Memory::Host
    }
    /// Every dtype moves. Every reduction runs (halves via f32, integer averages via i64; see
    /// the `stage` module docs) except on fp8, which is never reduced on the host, and the
    /// average of bools.
    fn supports(&self, dtype: DType, op: Option<ReduceOp>) -> bool {
        // Reductions run where grid-core's host kernels run them (MPI's own operators, or
        // staging through the kernels, give the same results).
        grid_core::kernels::runs(dtype, op)
    }
    /// Collectives that move at least 2 KiB on a rank are checked by default
    /// ([`CHECK_THRESHOLD`]): a count that differs between ranks makes Open MPI 4.1's
    /// collectives corrupt memory or crash (a segmentation fault) as soon as one rank receives
    /// a message larger than its buffer by the rendezvous protocol (above the 4 KiB eager limit
    /// of the shared-memory transport; measured: 4 against 1020 `i32`, 4 against 16383, 4
    /// against 65536). Below the threshold on every rank, every message is eager and a
    /// mismatch is reported by MPI (`MPI_ERR_TRUNCATE` on the rank that receives too much) or
    /// goes unnoticed on the other ranks (wrong data), but never crashes. A rank that checks
    /// runs the check on a duplicate communicator, so when ranks straddle the threshold, the
    /// checking ranks and the others wait for each other until the time limit (the job then
    /// ends, see "Time limits and abort" in the crate docs). `GRID_DEBUG=detail` checks every
    /// collective, `GRID_DEBUG=off` none.
    fn mismatch_check_default(&self) -> MismatchCheck {
        MismatchCheck::Above(CHECK_THRESHOLD)
    }
    /// MPI tags are non-negative C `int`s.
    fn max_tag(&self) -> u32 {
        i32::MAX as u32
    }
    /// The configured timeout ([`crate::MpiConfig::timeout`], `GRID_MPI_TIMEOUT_MS`, default
    /// [`crate::MpiConfig::DEFAULT_TIMEOUT_MS`]).
    fn default_time_limit(&self) -> TimeLimit {
        self.timeout
    }
    /// Sets the abort flag that every completion loop of this communicator checks, and wakes
    /// the watchdog: a blocked receive (blocking or nonblocking) is cancelled and returns; a
    /// blocked collective or send, which MPI cannot cancel, ends the job (exit code
    /// [`crate::EXIT_ABORTED`], see the crate docs); a nonblocking collective or send being
    /// waited for returns and its buffers are leaked.
    fn abort(&self) {
        self.watch.abort();
    }
    fn check_live(&self, op: &'static str) -> Result<()> {
        if self.finished.load(Ordering::Acquire) {
            return Err(Error::Finalized {
                op,
                state: "finished",
            });
        }
        if raw::FINALIZED.load(Ordering::Acquire) {
            return Err(Error::Finalized {
                op,
                state: "finalized (MPI_Finalize ran)",
            });
        }
        Ok(())
    }

    fn run(&self, mut op: Validated<Op<'_>>) -> Result<()> {
        match op.take_check() {
            None => self.exec(&self.raw, false, op, None),
            Some(check) => self.run_checked(&check, op),
        }
    }

    /// Blocking collectives carry their check to [`Backend::run`], which sends the fingerprint
    /// with the data in one round where it fits ([`ROUND_MAX`]); nonblocking ones are checked
    /// by the front end at their start ([`Backend::run_check`]), only in the `All` mode.
    fn checks_when_run(&self, nonblocking: bool) -> bool {
        !nonblocking
    }

    /// On the duplicate communicator, the same way as a blocking collective's check
    /// ([`MpiBackend`]'s `check_alone`): a rank that checks never meets the real operation of a
    /// rank that does not (ranks on both sides of the size threshold then wait for each other
    /// until their time limit, instead of mixing the check's messages with the data).
    fn run_check(&self, check: &DeferredCheck, seq: u64, limit: TimeLimit) -> Result<()> {
        self.check_alone(check, seq, limit)
    }

    fn start(&self, request: Validated<Request>) -> Result<Box<dyn Work>> {
        let limit = request.time_limit();
        let request = request.into_op();
        let name = request.name();
        let peer = match &request {
            Request::Send { peer, .. } | Request::Recv { peer, .. } => Some(*peer),
            _ => None,
        };
        let size = self.size;
        let (what, bufs, post) = match request {
            Request::AllReduce { buf, op } => {
                let buf = owned(name, buf)?;
                let plan = stage::plan(buf.dtype(), op, size);
                let in_place = raw::in_place_supported();
                match plan.wire {
                    None if in_place => (
                        Immediate::AllReduceInPlace(plan.op),
                        vec![buf],
                        post_native(0, plan.divide),
                    ),
                    None => {
                        let recv = buf.clone();
                        (
                            Immediate::AllReduce(plan.op),
                            vec![buf, recv],
                            post_native(1, plan.divide),
                        )
                    }
                    Some(w) => {
                        let s = stage::widen(buf.as_slice(), w);
                        let (what, bufs, idx) = if in_place {
                            (Immediate::AllReduceInPlace(plan.op), vec![s], 0)
                        } else {
                            let r = HostBuffer::zeros(w, s.len());
                            (Immediate::AllReduce(plan.op), vec![s, r], 1)
                        };
                        (
                            what,
                            bufs,
                            Post::Narrow {
                                idx,
                                out: buf,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::AllReduceInto { send, recv, op } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                let plan = stage::plan(send.dtype(), op, size);
                match plan.wire {
                    None => (
                        Immediate::AllReduce(plan.op),
                        vec![send, recv],
                        post_native(1, plan.divide),
                    ),
                    Some(w) => {
                        let s = stage::widen(send.as_slice(), w);
                        let r = HostBuffer::zeros(w, s.len());
                        (
                            Immediate::AllReduce(plan.op),
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: recv,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::Broadcast { buf, root } => {
                let buf = owned(name, buf)?;
                (Immediate::Broadcast(root), vec![buf], Post::Take(0))
            }
            Request::AllGather { send, recv } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                (Immediate::AllGather, vec![send, recv], Post::Take(1))
            }
            Request::ReduceScatter { send, recv, op } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                let plan = stage::plan(send.dtype(), op, size);
                match plan.wire {
                    None => (
                        Immediate::ReduceScatter(plan.op),
                        vec![send, recv],
                        post_native(1, plan.divide),
                    ),
                    Some(w) => {
                        let s = stage::widen(send.as_slice(), w);
                        let r = HostBuffer::zeros(w, recv.len() * plan.parts);
                        (
                            Immediate::ReduceScatter(plan.op),
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: recv,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::AllToAll { send, recv } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                (Immediate::AllToAll, vec![send, recv], Post::Take(1))
            }
            Request::AllGatherInPlace { buf } => {
                let buf = owned(name, buf)?;
                if raw::in_place_supported() {
                    (Immediate::AllGatherInPlace, vec![buf], Post::Take(0))
                } else {
                    // MPI_IN_PLACE unknown: one copy of this rank's block.
                    let k = buf.len() / size.max(1);
                    let mine = block_of(name, buf.as_slice(), self.rank * k, k)?.to_owned_buffer();
                    (Immediate::AllGather, vec![mine, buf], Post::Take(1))
                }
            }
            Request::ReduceScatterInPlace { buf, op } => {
                let buf = owned(name, buf)?;
                let k = buf.len() / size.max(1);
                let at = self.rank * k;
                let plan = stage::plan(buf.dtype(), op, size);
                let in_place = raw::in_place_supported();
                match plan.wire {
                    // MPI's result at the start of the buffer, moved to rank · k at the end.
                    None if in_place => (
                        Immediate::ReduceScatterInPlace(plan.op),
                        vec![buf],
                        Post::Block {
                            idx: 0,
                            from: 0,
                            out: None,
                            at,
                            k,
                            plan,
                        },
                    ),
                    _ => {
                        let wire = match plan.wire {
                            Some(w) => stage::widen(buf.as_slice(), w),
                            None => buf.clone(),
                        };
                        let (what, bufs, idx) = if in_place {
                            (Immediate::ReduceScatterInPlace(plan.op), vec![wire], 0)
                        } else {
                            let r = HostBuffer::zeros(wire.dtype(), k * plan.parts);
                            (Immediate::ReduceScatter(plan.op), vec![wire, r], 1)
                        };
                        (
                            what,
                            bufs,
                            Post::Block {
                                idx,
                                from: 0,
                                out: Some(buf),
                                at,
                                k,
                                plan,
                            },
                        )
                    }
                }
            }
            Request::Barrier => (Immediate::Barrier, vec![], Post::Empty),
            Request::Send { buf, peer, tag } => {
                let buf = owned(name, buf)?;
                (Immediate::Send(peer, tag), vec![buf], Post::Take(0))
            }
            Request::Recv { buf, peer, tag } => {
                let buf = owned(name, buf)?;
                let expected = buf.len();
                (
                    Immediate::Recv(peer, tag),
                    vec![buf],
                    Post::Received { expected },
                )
            }
            Request::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                (
                    Immediate::AllToAllV {
                        send_counts,
                        recv_counts,
                    },
                    vec![send, recv],
                    Post::Take(1),
                )
            }
            Request::AllGatherV {
                send,
                recv,
                recv_counts,
            } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                (
                    Immediate::AllGatherV { recv_counts },
                    vec![send, recv],
                    Post::Take(1),
                )
            }
            Request::ReduceScatterV {
                send,
                send_counts,
                recv,
                op,
            } => {
                let (send, recv) = (owned(name, send)?, owned(name, recv)?);
                let plan = stage::plan(send.dtype(), op, size);
                let what = Immediate::ReduceScatterV {
                    counts: send_counts.iter().map(|&n| n * plan.parts).collect(),
                    op: plan.op,
                };
                match plan.wire {
                    None => (what, vec![send, recv], post_native(1, plan.divide)),
                    Some(w) => {
                        let s = stage::widen(send.as_slice(), w);
                        let r = HostBuffer::zeros(w, recv.len() * plan.parts);
                        (
                            what,
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: recv,
                                divide: plan.divide,
                            },
                        )
                    }
                }
            }
            Request::Reduce {
                send,
                recv,
                op,
                root,
            } => {
                let send = owned(name, send)?;
                let recv = recv.map(|r| owned(name, r)).transpose()?;
                let plan = stage::plan(send.dtype(), op, size);
                let what = Immediate::Reduce { op: plan.op, root };
                match (plan.wire, recv) {
                    // The root: the result.
                    (None, Some(recv)) => (what, vec![send, recv], post_native(1, plan.divide)),
                    (Some(w), Some(recv)) => {
                        let s = stage::widen(send.as_slice(), w);
                        let r = HostBuffer::zeros(w, recv.len() * plan.parts);
                        (
                            what,
                            vec![s, r],
                            Post::Narrow {
                                idx: 1,
                                out: recv,
                                divide: plan.divide,
                            },
                        )
                    }
                    // Elsewhere: the input, handed back unchanged.
                    (None, None) => (what, vec![send], Post::Take(0)),
                    (Some(w), None) => {
                        let s = stage::widen(send.as_slice(), w);
                        (what, vec![s], Post::Give(send))
                    }
                }
            }
            Request::Gather { send, recv, root } => {
                let send = owned(name, send)?;
                match recv.map(|r| owned(name, r)).transpose()? {
                    Some(recv) => (Immediate::Gather { root }, vec![send, recv], Post::Take(1)),
                    None => (Immediate::Gather { root }, vec![send], Post::Take(0)),
                }
            }
            Request::Scatter { send, recv, root } => {
                let recv = owned(name, recv)?;
                match send.map(|s| owned(name, s)).transpose()? {
                    Some(send) => (Immediate::Scatter { root }, vec![recv, send], Post::Take(0)),
                    None => (Immediate::Scatter { root }, vec![recv], Post::Take(0)),
                }
            }
        };
        let pending = self.raw.start(what, bufs).map_err(|e| self.err(name, e))?;
        Ok(Box::new(MpiWork {
            op: name,
            comm: self.name.clone(),
            pending: Some(pending),
            post: Some(post),
            limit,
            peer,
            waiting_since: None,
            watch: Arc::clone(&self.watch),
        }))
    }
}

fn post_native(idx: usize, divide: Option<usize>) -> Post {
    match divide {
        Some(n) => Post::Divide { idx, n },
        None => Post::Take(idx),
    }
}

/// How a completed operation's buffers become its result.
enum Post {
    Take(usize),
    Divide {
        idx: usize,
        n: usize,
    },
    Narrow {
        idx: usize,
        out: HostBuffer,
        divide: Option<usize>,
    },
    Received {
        expected: usize,
    },
    /// This buffer, not one MPI used (a staged reduce off the root hands its input back).
    Give(HostBuffer),
    /// An in-place reduce-scatter's block: `k` elements (`k · plan.parts` of the wire type)
    /// at `from` of buffer `idx` become elements `at..at + k` of `out` (narrowed, divided as
    /// `plan` says), or, with no `out`, of buffer `idx` itself (moved there with one
    /// `copy_within`); the whole buffer is the result.
    Block {
        idx: usize,
        from: usize,
        out: Option<HostBuffer>,
        at: usize,
        k: usize,
        plan: Plan,
    },
    Empty,
}

/// The [`Work`] handle of the MPI backend: an MPI request plus the buffers it owns.
///
/// Its time limit runs from the first [`Work::wait`] or [`Work::wait_timeout`] (an operation
/// that nobody waits for may not progress under MPI). Past it, or after `abort()`, a receive is
/// cancelled and any other operation (which MPI cannot cancel) is abandoned: the wait returns
/// [`Error::Timeout`] (or the front end's [`Error::Aborted`]) and the buffers are leaked, never
/// freed, so that MPI can still write them safely. Dropping the work before it completed does
/// not wait: a receive is cancelled (so that it cannot take a later message); any other
/// operation's buffers are leaked the same way and MPI completes the operation on its own.
struct MpiWork {
    op: &'static str,
    comm: String,
    pending: Option<Pending>,
    post: Option<Post>,
    limit: TimeLimit,
    peer: Option<usize>,
    /// When the first wait began.
    waiting_since: Option<Instant>,
    watch: Arc<Watch>,
}

impl MpiWork {
    /// The part of the time limit left, from the first wait.
    fn remaining(&mut self) -> Option<Duration> {
        let since = *self.waiting_since.get_or_insert_with(Instant::now);
        self.limit
            .duration()
            .map(|l| l.saturating_sub(since.elapsed()))
    }

    fn finish(&mut self) -> Result<Tensor> {
        let op = self.op;
        let remaining = self.remaining();
        let pending = self
            .pending
            .take()
            .ok_or_else(|| Error::Invalid(format!("{op}: work already waited on")))?;
        let (mut bufs, received) = pending
            .wait_within(remaining, &self.watch.aborted)
            .map_err(|e| backend_err(op, &self.comm, e))?
            .map_err(|why| stopped(op, self.limit, self.peer, why))?;
        let take = |bufs: &mut Vec<HostBuffer>, i: usize| -> Result<HostBuffer> {
            if i < bufs.len() {
                Ok(bufs.swap_remove(i))
            } else {
                Err(Error::Invalid(format!(
                    "{op}: internal: result buffer {i} missing"
                )))
            }
        };
        let out = match self.post.take() {
            Some(Post::Take(i)) => take(&mut bufs, i)?,
            Some(Post::Divide { idx, n }) => {
                let mut b = take(&mut bufs, idx)?;
                grid_core::kernels::divide(b.as_mut_slice(), n);
                b
            }
            Some(Post::Narrow {
                idx,
                mut out,
                divide,
            }) => {
                let wide = take(&mut bufs, idx)?;
                stage::narrow(wide.as_slice(), out.as_mut_slice(), divide);
                out
            }
            Some(Post::Received { expected }) => {
                let b = take(&mut bufs, 0)?;
                grid_core::comm::check::len(
                    op,
                    "received message",
                    expected,
                    received.unwrap_or(expected),
                )?;
                b
            }
            Some(Post::Give(b)) => b,
            Some(Post::Block {
                idx,
                from,
                out,
                at,
                k,
                plan,
            }) => {
                let mut b = take(&mut bufs, idx)?;
                match out {
                    None => {
                        let mut s = b.as_mut_slice();
                        if from != at {
                            s.copy_within(from, k, at)?;
                        }
                        if let Some(n) = plan.divide {
                            grid_core::kernels::divide(block_mut(op, &mut s, at, k)?, n);
                        }
                        b
                    }
                    Some(mut out) => {
                        let src = block_of(op, b.as_slice(), from, k * plan.parts)?;
                        let mut o = out.as_mut_slice();
                        let mut dst = block_mut(op, &mut o, at, k)?;
                        // Same type: a copy (then the average's division); else a narrowing.
                        stage::narrow(src, dst.reborrow(), plan.divide);
                        if let (None, Some(n)) = (plan.wire, plan.divide) {
                            grid_core::kernels::divide(dst, n);
                        }
                        out
                    }
                }
            }
            Some(Post::Empty) | None => HostBuffer::zeros(DType::U8, 0),
        };
        Ok(Tensor::Host(out))
    }
}

impl Work for MpiWork {
    fn is_completed(&mut self) -> bool {
        match self.pending.as_mut() {
            Some(p) => p.test().unwrap_or(true),
            None => true,
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.finish()
    }

    fn wait_timeout(
        mut self: Box<Self>,
        timeout: Duration,
    ) -> std::result::Result<Result<Tensor>, Box<dyn Work>> {
        // `None`: a timeout beyond what `Instant` can hold, which is no limit.
        let deadline = TimeLimit::After(timeout).deadline_from(Instant::now());
        let mut spins = 0u32;
        loop {
            // Past the operation's own limit, or aborted: `finish` gives it up at once.
            if self.watch.is_aborted() || self.remaining() == Some(Duration::ZERO) {
                return Ok(self.finish());
            }
            let done = match self.pending.as_mut() {
                Some(p) => match p.test() {
                    Ok(d) => d,
                    Err(e) => return Ok(Err(backend_err(self.op, &self.comm, e))),
                },
                None => true,
            };
            if done {
                return Ok(self.finish());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self);
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
