//! Receive buffers are reused without the user doing anything: a tensor a bridge or pipeline
//! communicator returned gives its buffer back to the communicator's pool when dropped, and the
//! next receive of that size gets the same memory.

mod common;
use common::check::l3;
use common::check::{grid, value};
use common::scenarios::{two_encoders_spec, LAY};
use common::threads::{run_world, ThreadComm, ThreadFactory};
use grid_core::DType;
use multimodule::{
    Activation, BridgeCommunicator, BridgePlan, BufferPool, DimMapping,
    MultiModulePipelineCommunicator, PipelinePlan, ShapeMode,
};
use std::sync::Arc;

#[test]
fn dropped_outputs_come_back_and_are_reused() {
    // 1:1 and fan-in 2 -> 1, variable and static shapes: the destination's second receive lands
    // in the memory of the first once that was dropped; a kept or detached tensor is not reused.
    for (lanes, mode) in [
        (1, ShapeMode::Variable),
        (1, ShapeMode::Learned),
        (2, ShapeMode::Variable),
        (
            2,
            ShapeMode::Static {
                shape: vec![2, 2, 3],
                dtype: DType::F64,
            },
        ),
    ] {
        let plan = BridgePlan::new(
            "a",
            grid(1, 1, 1, lanes, 0),
            "b",
            grid(1, 1, 1, 1, lanes),
            3,
            DimMapping::default(),
        )
        .unwrap();
        let (res, _) = run_world(lanes + 1, true, |rank, comm: Arc<ThreadComm>| -> usize {
            let bridge = BridgeCommunicator::new(&ThreadFactory, comm, plan.clone(), 40)
                .unwrap()
                .with_shape_mode(mode.clone())
                .unwrap();
            let x = |mb| l3(2).build(2, 2, move |b, s, h| value(mb, rank, b, s, h));
            if rank < lanes {
                for mb in 0..5 {
                    bridge.send_forward(&x(mb)).unwrap();
                }
                return 0;
            }
            let rows = |mb: usize| move |b: usize, s, h| value(mb, b / 2, b % 2, s, h);
            let n = 2 * lanes;
            let t0 = bridge.recv_forward().unwrap().unwrap();
            l3(2).check(&t0, n, 2, "mb 0", rows(0));
            assert!(t0.is_pooled());
            assert!(!t0.clone().is_pooled());
            let p0 = t0.data().as_slice().as_ptr();
            drop(t0);
            assert_eq!(bridge.pool().len(), 1);
            let t1 = bridge.recv_forward().unwrap().unwrap();
            l3(2).check(&t1, n, 2, "mb 1", rows(1));
            assert_eq!(
                t1.data().as_slice().as_ptr(),
                p0,
                "mb 1 reuses mb 0's buffer"
            );
            assert!(bridge.pool().is_empty());
            // Kept: the next receive gets other memory.
            let t2 = bridge.recv_forward().unwrap().unwrap();
            l3(2).check(&t2, n, 2, "mb 2", rows(2));
            assert_ne!(t2.data().as_slice().as_ptr(), p0);
            // Detached tensors are freed, not pooled; explicit recycle() still works.
            drop(t1.detach());
            assert!(bridge.pool().is_empty());
            bridge.recycle(t2);
            assert_eq!(bridge.pool().len(), 1);
            let t3 = bridge.recv_forward().unwrap().unwrap();
            l3(2).check(&t3, n, 2, "mb 3", rows(3));
            let t4 = bridge.recv_forward().unwrap().unwrap();
            l3(2).check(&t4, n, 2, "mb 4", rows(4));
            let checked = t3.numel() + t4.numel();
            drop((t3, t4));
            assert_eq!(bridge.pool().len(), 2);
            checked
        });
        assert_eq!(res.iter().sum::<usize>(), 2 * 2 * lanes * 2 * 3);
    }
}

#[test]
fn pipeline_outputs_come_back_to_the_shared_pool() {
    let spec = two_encoders_spec();
    let plan = PipelinePlan::new(&spec).unwrap();
    let (res, _) = run_world(8, false, |rank, comm: Arc<ThreadComm>| -> usize {
        let mm = MultiModulePipelineCommunicator::new(&ThreadFactory, comm, &plan, 0).unwrap();
        let module = mm.modules()[0].name.clone();
        let mut ptrs = Vec::new();
        for mb in 0..3 {
            let inputs = mm.recv_forward(&module).unwrap();
            ptrs.push(
                inputs
                    .iter()
                    .map(|(_, t)| t)
                    .map(|t| t.data().as_slice().as_ptr())
                    .collect::<Vec<_>>(),
            );
            assert!(inputs.iter().all(|(_, t)| t.is_pooled()));
            let out = match module.as_str() {
                "image_encoder" => LAY.build(2, 2, |b, s, h| value(mb, rank, b, s, h)),
                "audio_encoder" => LAY.build(4, 2, |b, s, h| value(mb, 5, b, s, h)),
                _ => LAY.build(4, 2, |b, s, h| value(mb, 9, b, s, h)),
            };
            mm.send_forward(&module, &out).unwrap();
            drop(inputs);
        }
        // Each micro-batch's inputs land in the buffers the previous one gave back.
        assert!(ptrs.windows(2).all(|w| {
            let (mut a, mut b) = (w[0].clone(), w[1].clone());
            a.sort();
            b.sort();
            a == b
        }));
        ptrs[0].len()
    });
    // llm stage 0 (2 ranks) gets 2 inputs, stage 1 (2 ranks) and the generator 1 each.
    assert_eq!(res.iter().sum::<usize>(), 2 * 2 + 2 + 1);
}

#[test]
fn pool_limits_and_best_fit() {
    let pool = BufferPool::with_limits(2, 64);
    let t = |n: usize| Activation::from_vec(vec![n], vec![0f32; n]).unwrap();
    pool.put(t(4)); // 16 bytes
    pool.put(t(8)); // 32 bytes
    pool.put(t(2)); // 8 bytes: the oldest (4) goes, at most 2 buffers
    assert_eq!((pool.len(), pool.bytes()), (2, 40));
    pool.put(t(100)); // larger than the pool: not kept
    assert_eq!(pool.len(), 2);
    // Best fit: 5 elements come from the 8-element buffer (<= 2x), not from a new one.
    assert_eq!(pool.take(DType::F32, 5).len(), 5);
    assert_eq!((pool.len(), pool.bytes()), (1, 8));
    // No buffer of another dtype or more than twice the size is used.
    assert_eq!(pool.take(DType::F64, 2).dtype(), DType::F64);
    assert_eq!(pool.len(), 1);
    pool.put(t(16)); // 64 bytes: the 2-element buffer goes to stay within 64 bytes
    assert_eq!((pool.len(), pool.bytes()), (1, 64));
    assert_eq!(pool.take(DType::F32, 7).len(), 7); // 16 > 2 * 7: a new buffer
    assert_eq!(pool.len(), 1);
    assert_eq!(pool.take(DType::F32, 9).len(), 9); // 16 <= 2 * 9: the kept one
    assert!(pool.is_empty());
    assert!(BufferPool::with_limits(0, 1 << 20).is_empty());
}

#[test]
fn placed_takes_pass_over_kept_buffers_in_the_slow_window() {
    use grid_core::ReceivePlacement;
    let pool = BufferPool::default();
    let n = 1usize << 18; // 1 MiB of f32
    pool.put(Activation::from_vec(vec![n], vec![0f32; n]).unwrap());
    let kept_at = |pool: &BufferPool| {
        let b = pool.take(DType::F32, n);
        let at = b.as_slice().as_ptr() as usize;
        pool.put(Activation::new(vec![n], b).unwrap());
        at
    };
    let at = kept_at(&pool);
    // A transport whose window holds the kept buffer's start (16 bytes after its framing).
    let lead = (at % 4096 + 4096 - 16) % 4096;
    let slow = ReceivePlacement::after_framing(lead, 64 << 10);
    assert!(slow.is_slow_offset(at));
    // Passed over: a new buffer outside the window; the kept one stays kept.
    let b = pool.take_placed(DType::F32, n, Some(&slow));
    assert_ne!(b.as_slice().as_ptr() as usize, at);
    assert_eq!((b.len(), pool.len()), (n, 1));
    // Receives under `min_bytes`, and takes without a placement, get the kept buffer.
    let small = ReceivePlacement::after_framing(lead, 8 << 20);
    let c = pool.take_placed(DType::F32, n, Some(&small));
    assert_eq!((c.as_slice().as_ptr() as usize, pool.len()), (at, 0));
    pool.put(Activation::new(vec![n], c).unwrap());
    let d = pool.take_placed(DType::F32, n, None);
    assert_eq!((d.as_slice().as_ptr() as usize, pool.len()), (at, 0));
    // A placement whose window misses the kept buffer takes it too.
    pool.put(Activation::new(vec![n], d).unwrap());
    let elsewhere = ReceivePlacement::after_framing(at % 4096, 64 << 10);
    let e = pool.take_placed(DType::F32, n, Some(&elsewhere));
    assert_eq!(e.as_slice().as_ptr() as usize, at);
}
