//! Live groups of a `LiveCommGrid` for every subset of dims of a 4-D grid and of a view on
//! MPI (8 processes), and named groups with their time limits.

use backend_mpi::{mpi_test, MpiFactory};
use grid_conformance::live::{check_live_groups, LiveGridCase, ViewCase};
use grid_core::{Communicator, GroupFactory, GroupOptions, TimeLimit};
use std::time::Duration;

mpi_test!(
    mpi_live_group_for_every_subset_np8,
    np = 8,
    timeout = 120,
    |rt| {
        let f = MpiFactory::new();
        let case = LiveGridCase {
            // 4-D over 8 ranks: one dimension of size 1 (its groups are single ranks).
            shape: vec![2, 2, 1, 2],
            names: vec!["tp", "cp", "dp", "pp"],
            view: Some(ViewCase {
                name: "expert",
                shape: vec![2, 2, 2],
                names: vec!["expt_tp", "ep", "pp"],
                shared: vec!["pp"],
            }),
        };
        let rep = check_live_groups(&f, rt.world(), &case)?;
        if (rep.created, rep.shared_with_base) != (21, 1) {
            return Err(format!("report {rep:?}"));
        }
        // One split per create_pg.
        if f.calls().splits != 21 {
            return Err(format!("{} splits, expected 21", f.calls().splits));
        }
        Ok(())
    }
);

mpi_test!(
    mpi_named_group_with_time_limit_np2,
    np = 2,
    timeout = 60,
    |rt| {
        let f = MpiFactory::new();
        let world = rt.world();
        let o = GroupOptions::new()
            .named("PAIR")
            .with_timeout(Duration::from_millis(1234));
        let g = f
            .split_with(world, Some(0), world.rank(), &o)
            .map_err(|e| e.to_string())?
            .ok_or("no group")?;
        if g.name() != "PAIR" || g.time_limit() != TimeLimit::from_millis(1234) {
            return Err(format!("{} {}", g.name(), g.time_limit()));
        }
        // Gloo options are not MPI's: rejected, with both backends named.
        let gloo = GroupOptions::new().with_backend(grid_core::BackendOptions::Gloo(
            grid_core::GlooGroupOptions::default(),
        ));
        match f.split_with(world, Some(0), world.rank(), &gloo) {
            Err(e)
                if e.to_string()
                    .contains("for 'gloo', but the factory creating it is 'mpi'") => {}
            other => return Err(format!("{:?}", other.map(|c| c.is_some()))),
        }
        Ok(())
    }
);
