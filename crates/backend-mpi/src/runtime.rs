//! MPI initialisation and the world communicator.

use crate::comm::{backend_err, MpiBackend, MpiCommunicator};
use crate::config::MpiConfig;
use crate::raw;
use grid_core::{Error, Result};
use mpi::Threading;

/// The MPI library of this process: `MPI_Init_thread(MPI_THREAD_MULTIPLE)` when created,
/// `MPI_Finalize` when dropped, and the world communicator in between.
///
/// MPI can be initialised **once per process**: a second [`MpiRuntime::init`] (also after the
/// first runtime was dropped) returns an error. Keep the runtime alive for as long as MPI is
/// used, typically in `main`. Communicators that outlive it report
/// [`Error::Finalized`] and are not freed (MPI_Finalize released them).
///
/// ```no_run
/// use backend_mpi::MpiRuntime;
/// use grid_core::Communicator;
/// let rt = MpiRuntime::init()?;
/// println!("rank {} of {}", rt.world().rank(), rt.world().size());
/// # Ok::<(), grid_core::Error>(())
/// ```
pub struct MpiRuntime {
    // Field order matters: fields drop in declaration order, so the world communicator is
    // freed before the finalizer runs MPI_Finalize.
    world: MpiCommunicator,
    _finalizer: Finalizer,
    threading: Threading,
}

impl std::fmt::Debug for MpiRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiRuntime")
            .field("world_rank", &grid_core::Communicator::rank(&self.world))
            .field("world_size", &grid_core::Communicator::size(&self.world))
            .field("threading", &self.threading)
            .finish()
    }
}

/// The Open MPI setting that keeps a message longer than its receive from corrupting the
/// receiver's memory.
pub const SINGLE_COPY_VAR: &str = "OMPI_MCA_btl_vader_single_copy_mechanism";

/// Makes Open MPI's shared-memory transport (vader) copy through its own buffers instead of its
/// single-copy mechanism (CMA), unless the user chose one ([`SINGLE_COPY_VAR`] set, as
/// `mpirun --mca btl_vader_single_copy_mechanism ...` sets it). With CMA, Open MPI 4.1 as
/// packaged here copies a message longer than the posted receive (above its 4 KiB eager limit)
/// past the end of the receive buffer: the receiving rank's heap is corrupted (`malloc():
/// invalid size`, then SIGABRT or a hang), instead of `MPI_ERR_TRUNCATE`. Without it the
/// receive fails cleanly. Measured on the 2-core build machine, the copy path is also not
/// slower: broadcast of 8 to 64 MiB between 2 ranks took 3.1 ms instead of 5.0 ms at 64 MiB
/// (docs/performance.md). Runs before `MPI_Init`, on the thread that initialises MPI, before
/// any thread of this library exists.
fn avoid_single_copy_overrun() {
    if std::env::var_os(SINGLE_COPY_VAR).is_none() {
        std::env::set_var(SINGLE_COPY_VAR, "none");
    }
}

/// The Open MPI setting for the size of the fragments through which the shared-memory
/// transport (vader) copies a message above its eager limit when it does not use a single-copy
/// mechanism.
pub const FRAGMENT_SIZE_VAR: &str = "OMPI_MCA_btl_vader_max_send_size";

/// The fragment size ([`FRAGMENT_SIZE_VAR`]) this library sets when the user chose none:
/// 128 KiB, against Open MPI's default of 32 KiB.
///
/// Measured on the 2-core build machine (Open MPI 4.1.4, copy path; docs/performance.md,
/// *Larger copy fragments*): from 512 KiB, broadcast, all-gather, reduce-scatter and
/// all-reduce took up to 1.5 times less time at 2 and 4 ranks (`mpi-bench collectives`, five
/// rounds), and `MPI_Alltoall` at 8 ranks 1.1–1.6 times less; smaller messages did not change
/// beyond the noise, except the 2-rank broadcast of 128 KiB (about 0.3 µs slower). 256 KiB
/// was a little faster again at 32–64 MiB, but the transport allocates its first 8 fragments
/// in its shared segment (`btl_vader_segment_size`, 4 MiB by default) at `MPI_Init`: 512 KiB
/// fragments already failed there, so this stays at a quarter of the segment.
pub const FRAGMENT_SIZE: usize = 128 << 10;

/// The Open MPI setting for the size of the transport's shared segment, from which the
/// fragments are allocated.
const SEGMENT_SIZE_VAR: &str = "OMPI_MCA_btl_vader_segment_size";

/// Copies large messages through [`FRAGMENT_SIZE`] fragments instead of Open MPI's 32 KiB,
/// only where the copy path is in use ([`SINGLE_COPY_VAR`] is `none`, as
/// [`avoid_single_copy_overrun`] sets it) and the user set neither the fragment size nor the
/// segment size (`mpirun --mca btl_vader_max_send_size ...` sets [`FRAGMENT_SIZE_VAR`]).
/// Runs before `MPI_Init`, as [`avoid_single_copy_overrun`], after it.
fn larger_copy_fragments() {
    let copy_path = std::env::var_os(SINGLE_COPY_VAR).is_some_and(|v| v == "none");
    if copy_path
        && std::env::var_os(FRAGMENT_SIZE_VAR).is_none()
        && std::env::var_os(SEGMENT_SIZE_VAR).is_none()
    {
        std::env::set_var(FRAGMENT_SIZE_VAR, FRAGMENT_SIZE.to_string());
    }
}

impl MpiRuntime {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE`, installs `MPI_ERRORS_RETURN` on
    /// `MPI_COMM_WORLD` and creates the world communicator (a duplicate of `MPI_COMM_WORLD`).
    ///
    /// Fails if MPI was already initialised in this process, or if the library cannot provide
    /// `MPI_THREAD_MULTIPLE` (the communicators are `Send + Sync`, which needs it).
    ///
    /// Before `MPI_Init` it sets two Open MPI settings in this process's environment, each only
    /// if the user has not (an `mpirun --mca` option or an exported variable wins): the
    /// shared-memory transport copies through its own buffers ([`SINGLE_COPY_VAR`] = `none`:
    /// with CMA a message longer than its receive corrupts the receiver's heap), and on that
    /// copy path it moves large messages in [`FRAGMENT_SIZE`] fragments ([`FRAGMENT_SIZE_VAR`]).
    ///
    /// ```no_run
    /// let rt = backend_mpi::MpiRuntime::init()?;
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn init() -> Result<MpiRuntime> {
        MpiRuntime::init_with(MpiConfig::from_env()?)
    }

    /// [`MpiRuntime::init`] with explicit settings (instead of [`MpiConfig::from_env`]).
    ///
    /// ```no_run
    /// use backend_mpi::{MpiConfig, MpiRuntime};
    /// use grid_core::{Communicator, TimeLimit};
    /// let rt = MpiRuntime::init_with(MpiConfig::default().with_timeout(TimeLimit::from_millis(30_000)))?;
    /// assert_eq!(rt.world().time_limit(), TimeLimit::from_millis(30_000));
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn init_with(config: MpiConfig) -> Result<MpiRuntime> {
        avoid_single_copy_overrun();
        larger_copy_fragments();
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                Error::Invalid(
                    "MPI is already initialised in this process (or was finalized): MPI can be \
                 initialised only once per process; keep one MpiRuntime for the whole program"
                        .into(),
                )
            })?;
        if threading != Threading::Multiple {
            drop(universe);
            raw::mark_finalized();
            return Err(grid_core::LibraryError::new(
                "mpi",
                "init",
                format!(
                    "the MPI library provides thread level {threading:?}, but MPI_THREAD_MULTIPLE is \
                     required (Open MPI and MPICH from Debian provide it)"
                ),
            )
            .comm("world")
            .class("MPI_THREAD_MULTIPLE unavailable")
            .into());
        }
        let world = raw::Comm::world_dup().map_err(|e| backend_err("init", "world", e));
        let world = match world
            .and_then(|c| MpiBackend::from_raw(c, "init", "world".into(), config.timeout))
        {
            Ok(w) => w,
            Err(e) => {
                raw::mark_finalized();
                drop(universe);
                return Err(e);
            }
        };
        #[cfg(unix)]
        if config.sigterm_report {
            crate::watch::install_sigterm_report();
        }
        Ok(MpiRuntime {
            world,
            _finalizer: Finalizer(Some(universe)),
            threading,
        })
    }

    /// The world communicator (all processes of the job). Its `global_ranks()` are
    /// `0..size`.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// use grid_core::Communicator;
    /// assert_eq!(rt.world().global_ranks().len(), rt.world().size());
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn world(&self) -> &MpiCommunicator {
        &self.world
    }

    /// The rsmpi world communicator, for calling rsmpi directly (benchmarks, interop). It uses
    /// `MPI_COMM_WORLD` itself, whose error handler this runtime set to `MPI_ERRORS_RETURN`.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// use mpi::traits::Communicator as _;
    /// let n = rt.rsmpi_world().size();
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn rsmpi_world(&self) -> mpi::topology::SimpleCommunicator {
        mpi::topology::SimpleCommunicator::world()
    }

    /// Terminates every process of the job with `code` (`MPI_Abort`). For a rank that failed
    /// and must not leave the others waiting forever.
    ///
    /// ```no_run
    /// # let rt = backend_mpi::MpiRuntime::init()?;
    /// rt.abort(1);
    /// # Ok::<(), grid_core::Error>(())
    /// ```
    pub fn abort(&self, code: i32) {
        raw::Comm::abort_world(code);
    }
}

/// Owns the rsmpi universe; marks MPI finalized right before `MPI_Finalize` runs.
struct Finalizer(Option<mpi::environment::Universe>);

impl Drop for Finalizer {
    fn drop(&mut self) {
        raw::mark_finalized();
        drop(self.0.take());
    }
}
