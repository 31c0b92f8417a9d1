//! GPU smoke tests. They run wherever a driver, libnccl and a GPU are present (one rank per
//! GPU, threads of this process) and otherwise print `SKIPPED: <reason>` and return.

mod common;

use backend_nccl::NcclDeviceBuffer;
use common::{gpus_or_skip, on_gpus};
use grid_core::{BufMut, BufRef, Communicator, CommunicatorExt, Error, GroupFactory, ReduceOp};
use half::bf16;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[test]
fn device_and_host_all_reduce() {
    let Some(n) = gpus_or_skip("device_and_host_all_reduce", 1) else {
        return;
    };
    let out = on_gpus(n, T, |_, w| {
        let r = w.rank() as f32;
        let send = w.to_device(&[r, 1.0, 2.0 * r]).unwrap();
        let mut recv: NcclDeviceBuffer<f32> = w.zeros(3).unwrap();
        w.all_reduce(
            BufRef::Device(&send),
            BufMut::Device(&mut recv),
            ReduceOp::Sum,
        )
        .unwrap();
        let dev = w.to_host(&recv).unwrap();
        let mut host = vec![bf16::ZERO; 2];
        w.all_reduce_into(
            &[bf16::from_f32(r), bf16::ONE][..],
            &mut host[..],
            ReduceOp::Max,
        )
        .unwrap();
        (dev, host)
    });
    let s: f32 = (0..n).map(|r| r as f32).sum();
    for (dev, host) in out {
        assert_eq!(dev, vec![s, n as f32, 2.0 * s]);
        assert_eq!(host, vec![bf16::from_f32((n - 1) as f32), bf16::ONE]);
    }
}

#[test]
fn split_members_and_ring_exchange() {
    let Some(n) = gpus_or_skip("split_members_and_ring_exchange", 2) else {
        return;
    };
    let out = on_gpus(n, T, |f, w| {
        let me = w.rank();
        // Pairs {0,1}, {2,3}, ...; an odd last rank stays alone.
        let sub = f.split(w, Some((me / 2) as u32), me).unwrap().unwrap();
        let members = sub.global_ranks().to_vec();
        // Ring over the world with receives posted first (deferred, grouped on wait).
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let rw = w.irecv::<i64>(4, left, 0).unwrap();
        let sw = w.isend(vec![me as i64; 4], right, 0).unwrap();
        let got = rw.wait().unwrap();
        sw.wait().unwrap();
        // Non-members of a group get None.
        let first = f.create_group(w, &[0]).unwrap().map(|c| c.size());
        (members, got, first)
    });
    for (me, (members, got, first)) in out.into_iter().enumerate() {
        let lo = me / 2 * 2;
        let want: Vec<usize> = (lo..(lo + 2).min(n)).collect();
        assert_eq!(members, want);
        assert_eq!(got, vec![((me + n - 1) % n) as i64; 4]);
        assert_eq!(first, (me == 0).then_some(1));
    }
}

#[test]
fn abort_all_stops_every_communicator() {
    let Some(n) = gpus_or_skip("abort_all_stops_every_communicator", 1) else {
        return;
    };
    let out = on_gpus(n, T, |f, w| {
        let sub = f.split(w, Some(0), w.rank()).unwrap().unwrap();
        w.barrier().unwrap();
        let aborted = f.abort_all();
        let e1 = w.barrier().unwrap_err();
        let e2 = sub
            .all_reduce_into(&[1i32][..], &mut [0i32][..], ReduceOp::Sum)
            .unwrap_err();
        (aborted, e1, e2, f.job().live_count())
    });
    for (aborted, e1, e2, live) in out {
        assert_eq!(aborted, 2);
        assert_eq!(
            e1,
            Error::Finalized {
                op: "barrier",
                state: "aborted"
            }
        );
        assert_eq!(
            e2,
            Error::Finalized {
                op: "all_reduce",
                state: "aborted"
            }
        );
        assert_eq!(live, 0);
    }
}
