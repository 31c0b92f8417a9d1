//! Behaviour of the local backend beyond the conformance suite: a rank that never arrives is
//! a time-out naming it, ranks that disagree get an error (never wrong data), nonblocking
//! operations do not block the caller, rendezvous sends wait for the receiver, and the
//! traffic statistics.

use backend_local::{run, LocalConfig, LocalWorld};
use grid_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::time::{Duration, Instant};

fn quick(rendezvous: bool) -> LocalConfig {
    LocalConfig {
        timeout: Duration::from_millis(300),
        rendezvous,
    }
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_it() {
    let r = run(3, &quick(false), |_, w| {
        if w.rank() == 2 {
            return Ok(None);
        }
        let mut v = [1i32];
        Ok(Some(w.all_reduce_in_place(&mut v[..], ReduceOp::Sum)))
    })
    .unwrap();
    for (rank, res) in r.into_iter().enumerate().take(2) {
        match res {
            Some(Err(Error::Timeout {
                op,
                peer,
                millis,
                at,
            })) => {
                assert_eq!(
                    (op, peer, millis),
                    ("all_reduce", Some(2), 300),
                    "rank {rank}"
                );
                // The front end names where it ran: communicator, members, sequence number.
                let at = at.expect("the front end adds the site");
                assert_eq!(
                    (at.comm.as_str(), at.ranks.as_slice(), at.seq),
                    ("world", &[0, 1, 2][..], Some(0))
                );
            }
            other => panic!("rank {rank}: expected a time-out, got {other:?}"),
        }
    }
}

#[test]
fn a_receive_without_a_sender_times_out() {
    let r = run(2, &quick(false), |_, w| {
        if w.rank() == 0 {
            let mut b = [0u8; 4];
            return Ok(Some(w.recv_from(&mut b[..], 1, 5)));
        }
        Ok(None)
    })
    .unwrap();
    assert!(matches!(
        r[0],
        Some(Err(Error::Timeout {
            op: "recv",
            peer: Some(1),
            ..
        }))
    ));
}

#[test]
fn ranks_that_disagree_get_an_error_not_data() {
    let r = run(2, &quick(false), |_, w| {
        let n = if w.rank() == 0 { 2 } else { 3 };
        let send = vec![1f32; n];
        let mut recv = vec![0f32; n];
        Ok(w.all_reduce_into(&send[..], &mut recv[..], ReduceOp::Sum))
    })
    .unwrap();
    for res in r {
        match res {
            Err(Error::Library(l)) => {
                assert_eq!((l.backend, l.op), ("local", "all_reduce"));
                assert_eq!(l.class.as_deref(), Some("mismatch"));
            }
            other => panic!("expected a mismatch error, got {other:?}"),
        }
    }
}

#[test]
fn nonblocking_start_does_not_wait_for_the_others() {
    let r = run(2, &LocalConfig::default(), |_, w| {
        if w.rank() == 0 {
            let t = Instant::now();
            let mut work = w.iall_reduce(vec![1i64, 2], ReduceOp::Sum)?;
            let started = t.elapsed();
            let early = work.is_completed();
            // Rank 1 joins only after this message.
            w.send_to(&[1u8][..], 1, 9)?;
            let v = work.wait()?;
            Ok((started < Duration::from_millis(200), early, v))
        } else {
            let mut go = [0u8];
            w.recv_from(&mut go[..], 0, 9)?;
            std::thread::sleep(Duration::from_millis(50));
            let v = w.iall_reduce(vec![10i64, 20], ReduceOp::Sum)?.wait()?;
            Ok((true, false, v))
        }
    })
    .unwrap();
    assert_eq!(r[0], (true, false, vec![11, 22]));
    assert_eq!(r[1].2, vec![11, 22]);
}

#[test]
fn rendezvous_sends_wait_for_the_receiver() {
    // Both ranks send first: fine without rendezvous, a time-out with it.
    let body = |_: &backend_local::LocalFactory, w: backend_local::LocalComm| {
        let peer = 1 - w.rank();
        let sent = w.send_to(&[w.rank() as i32; 8][..], peer, 1);
        let mut got = [0i32; 8];
        let recv = w.recv_from(&mut got[..], peer, 1);
        Ok((sent, recv.map(|_| got[0])))
    };
    let eager = run(2, &quick(false), body).unwrap();
    assert!(eager.iter().all(|(s, r)| s.is_ok() && r.is_ok()));
    assert_eq!(eager[0].1.as_ref().ok(), Some(&1));
    // With rendezvous the exchange deadlocks: a send times out (the first rank to give up
    // withdraws its message, so its peer may then complete), nobody hangs, and whatever was
    // received is the peer's data.
    let rdv = run(2, &quick(true), body).unwrap();
    assert!(rdv
        .iter()
        .any(|(s, _)| matches!(s, Err(Error::Timeout { op: "send", .. }))));
    for (rank, (_, r)) in rdv.iter().enumerate() {
        if let Ok(v) = r {
            assert_eq!(*v, 1 - rank as i32);
        }
    }
}

#[test]
fn statistics_record_messages_and_batches() {
    let world = LocalWorld::new(2).unwrap();
    let stats = world.stats();
    std::thread::scope(|s| {
        for c in world.communicators() {
            s.spawn(move || {
                let peer = 1 - c.rank();
                let out = [c.rank() as u8; 10];
                let mut inb = vec![0u8; 10];
                c.batch_p2p(vec![
                    grid_core::P2pOp::Send {
                        buf: (&out[..]).into(),
                        peer,
                        tag: 3,
                    },
                    grid_core::P2pOp::Recv {
                        buf: (&mut inb[..]).into(),
                        peer,
                        tag: 3,
                    },
                ])
                .unwrap();
                assert_eq!(inb, vec![peer as u8; 10]);
            });
        }
    });
    let mut m: Vec<_> = stats
        .messages()
        .iter()
        .map(|r| (r.src, r.dst, r.len))
        .collect();
    m.sort();
    assert_eq!(m, vec![(0, 1, 10), (1, 0, 10)]);
    assert_eq!((stats.batches(0), stats.batches(1)), (1, 1));
}

#[test]
fn an_empty_world_is_an_error() {
    assert!(matches!(
        LocalWorld::new(0),
        Err(Error::NonPositive { value: 0, .. })
    ));
}

#[test]
fn wait_timeout_of_duration_max_means_no_limit() {
    // A timeout beyond what `Instant` can hold waits like `wait` (it used to panic computing
    // the deadline).
    let r = run(2, &quick(false), |_, w| {
        if w.rank() == 0 {
            let work = w.irecv::<i32>(1, 1, 4)?.into_inner();
            return match work.wait_timeout(Duration::MAX) {
                Ok(r) => Ok(r?.into_vec::<i32>()?),
                Err(_) => Err(Error::Invalid("wait_timeout(MAX) gave up".into())),
            };
        }
        w.send_to(&[7i32][..], 0, 4)?;
        Ok(vec![])
    })
    .unwrap();
    assert_eq!(r[0], vec![7]);
}
