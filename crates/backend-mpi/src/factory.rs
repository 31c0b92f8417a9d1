//! [`MpiFactory`]: creates sub-communicators (`MPI_Comm_split`, `MPI_Comm_create`).

use crate::comm::{MpiBackend, MpiCommunicator};
use grid_core::comm::check;
use grid_core::{Communicator, Error, GroupFactory, Result};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Creates MPI communicators for sub-groups. Stateless apart from counters of the collective
/// creation calls it made on this rank ([`MpiFactory::calls`]), which benchmarks report.
///
/// Both methods are collective over the parent: every rank of the parent calls them in the
/// same order, members and non-members alike.
///
/// ```no_run
/// use backend_mpi::{MpiFactory, MpiRuntime};
/// use grid_core::{Communicator, GroupFactory};
/// let rt = MpiRuntime::init()?;
/// let f = MpiFactory::new();
/// let world = rt.world();
/// // Even and odd world ranks.
/// let half = f.split(world, Some((world.rank() % 2) as u32), world.rank())?;
/// // Ranks 0 and 1 only; everyone else gets None.
/// let pair = f.create_group(world, &[0, 1])?;
/// # Ok::<(), grid_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct MpiFactory {
    splits: AtomicUsize,
    creates: AtomicUsize,
}

/// Counts of communicator-creating collective calls made by one factory on this rank.
///
/// ```
/// let c = backend_mpi::FactoryCalls { splits: 2, creates: 0 };
/// assert_eq!(c.splits + c.creates, 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FactoryCalls {
    /// `MPI_Comm_split` calls.
    pub splits: usize,
    /// `MPI_Comm_create` calls.
    pub creates: usize,
}

impl MpiFactory {
    /// A new factory.
    ///
    /// ```
    /// let f = backend_mpi::MpiFactory::new();
    /// assert_eq!(f.calls().splits, 0);
    /// ```
    pub fn new() -> MpiFactory {
        MpiFactory::default()
    }

    /// The creation calls made so far on this rank.
    ///
    /// ```
    /// let f = backend_mpi::MpiFactory::new();
    /// assert_eq!(f.calls(), backend_mpi::FactoryCalls::default());
    /// ```
    pub fn calls(&self) -> FactoryCalls {
        FactoryCalls {
            splits: self.splits.load(Ordering::Relaxed),
            creates: self.creates.load(Ordering::Relaxed),
        }
    }
}

impl GroupFactory for MpiFactory {
    type Comm = MpiCommunicator;

    /// `MPI_Comm_split(parent, color or MPI_UNDEFINED, key)`.
    fn split(
        &self,
        parent: &MpiCommunicator,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<MpiCommunicator>> {
        self.split_named(parent, color, key, None, None)
    }

    /// `MPI_Comm_split`, creating the communicator under the options' name and with their
    /// time limit. MPI has no backend options: options for another backend are rejected.
    fn split_with(
        &self,
        parent: &MpiCommunicator,
        color: Option<u32>,
        key: usize,
        options: &grid_core::GroupOptions,
    ) -> Result<Option<MpiCommunicator>> {
        options.check_backend(parent.backend())?;
        self.split_named(parent, color, key, options.name.as_deref(), options.timeout)
    }

    /// `MPI_Comm_create_group` among the members only, with a tag derived from `identity`
    /// (see the trait); named `options.name`, else `identity`.
    fn create_members_only(
        &self,
        parent: &MpiCommunicator,
        members: &[usize],
        identity: &str,
        options: &grid_core::GroupOptions,
    ) -> Result<MpiCommunicator> {
        self.members_only(parent, members, identity, options)
    }

    /// `MPI_Comm_create` over `parent` with the group of `ranks` (sorted ascending, so the new
    /// communicator's ranks follow the parent's order). Collective over the parent.
    fn create_group(
        &self,
        parent: &MpiCommunicator,
        ranks: &[usize],
    ) -> Result<Option<MpiCommunicator>> {
        const OP: &str = "create_group";
        // The front end's check: refused once the parent was aborted or failed.
        parent.ensure_usable(OP)?;
        let sorted = check::group_members(OP, ranks, parent.size())?;
        let _s = tracing::debug_span!(
            "mpi.create_group",
            comm = parent.comm_name(),
            n = sorted.len()
        )
        .entered();
        let n = self.creates.fetch_add(1, Ordering::Relaxed);
        let _w = parent.creating(crate::watch::CREATE_GROUP, parent.time_limit());
        let raw = parent
            .raw()
            .create(&sorted)
            .map_err(|e| parent.err(OP, e))?;
        let name = format!("{}/group{n}", parent.comm_name());
        raw.map(|r| MpiBackend::from_raw(r, OP, name, parent.configured_timeout()))
            .transpose()
    }
}

impl MpiFactory {
    /// [`GroupFactory::create_members_only`]: `MPI_Comm_create_group`, called by the members
    /// only, with a tag derived from the identity (its 64-bit FNV-1a hash reduced to
    /// 0..=32767, the smallest `MPI_TAG_UB` the standard allows). MPI tells concurrent
    /// creations apart by tag; the creations of one rank are sequential, so two identities
    /// sharing a tag cannot be confused.
    fn members_only(
        &self,
        parent: &MpiCommunicator,
        members: &[usize],
        identity: &str,
        options: &grid_core::GroupOptions,
    ) -> Result<MpiCommunicator> {
        const OP: &str = "create_members_only";
        parent.ensure_usable(OP)?;
        options.check_backend(parent.backend())?;
        check::members_only(OP, members, parent.size(), parent.rank())?;
        let tag = identity_tag(identity);
        let _s = tracing::debug_span!(
            "mpi.create_members_only",
            comm = parent.comm_name(),
            identity,
            tag,
            n = members.len()
        )
        .entered();
        self.creates.fetch_add(1, Ordering::Relaxed);
        let _w = parent.creating(crate::watch::CREATE_GROUP, parent.time_limit());
        let raw = parent
            .raw()
            .create_group(members, tag)
            .map_err(|e| parent.err(OP, e))?;
        let name = options.name.clone().unwrap_or_else(|| identity.to_string());
        let timeout = options
            .timeout
            .unwrap_or_else(|| parent.configured_timeout());
        MpiBackend::from_raw(raw, OP, name, timeout)
    }

    fn split_named(
        &self,
        parent: &MpiCommunicator,
        color: Option<u32>,
        key: usize,
        name: Option<&str>,
        timeout: Option<grid_core::TimeLimit>,
    ) -> Result<Option<MpiCommunicator>> {
        const OP: &str = "split";

        // The front end's check: refused once the parent was aborted or failed.
        parent.ensure_usable(OP)?;
        if let Some(c) = color {
            if c > i32::MAX as u32 {
                return Err(Error::Invalid(format!("split: colour {c} exceeds the MPI limit {} (colours must be non-negative ints)", i32::MAX)));
            }
        }
        if key > i32::MAX as usize {
            return Err(Error::Invalid(format!(
                "split: key {key} exceeds the MPI limit {}",
                i32::MAX
            )));
        }
        let _s =
            tracing::debug_span!("mpi.split", comm = parent.comm_name(), ?color, key).entered();
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        // MPI_Comm_split and the new communicator's duplicate, under the parent's time limit.
        let _w = parent.creating(crate::watch::SPLIT, parent.time_limit());
        let raw = parent
            .raw()
            .split(color.map(|c| c as usize), key)
            .map_err(|e| parent.err(OP, e))?;
        let name = match (color, name) {
            (Some(_), Some(given)) => given.to_string(),
            (Some(c), None) => format!("{}/split{n}.{c}", parent.comm_name()),
            (None, _) => String::new(),
        };
        let timeout = timeout.unwrap_or_else(|| parent.configured_timeout());
        raw.map(|r| MpiBackend::from_raw(r, OP, name, timeout))
            .transpose()
    }
}

/// The `MPI_Comm_create_group` tag of a group identity: its FNV-1a hash in 0..=32767.
fn identity_tag(identity: &str) -> i32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in identity.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % 32768) as i32
}
