//! Argument checks of [`crate::NcclCommunicator`], as pure functions of the communicator's
//! shape so they are tested on CPU. Every check runs before cudarc or NCCL is touched.

use crate::error::BACKEND;
use grid_core::comm::check;
use grid_core::{DType, Error, ReduceOp, Request, Result};

/// What a queued collective does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::Broadcast(_) => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
        }
    }
    /// Whether the receive buffer is also an input (in-place operations).
    pub(crate) fn reads_recv(self) -> bool {
        matches!(self, Kind::Broadcast(_))
    }
}

/// Rank, size and device of a communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub size: usize,
    pub rank: usize,
    pub device: usize,
}

/// Every dtype moves; every reduction works on every dtype except `Avg` on integers.
pub(crate) fn supports(dtype: DType, op: Option<ReduceOp>) -> bool {
    op != Some(ReduceOp::Avg) || dtype.is_float()
}

impl Shape {
    pub(crate) fn reduce(&self, op: &'static str, dtype: DType, r: ReduceOp) -> Result<()> {
        if supports(dtype, Some(r)) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                op,
                backend: BACKEND,
                what: format!("{r} on {dtype} (Avg is for f32, f64, f16 and bf16; for integers use Sum and divide)"),
            })
        }
    }

    /// A peer of `send` / `recv`: a rank of the communicator other than this one.
    pub(crate) fn peer(&self, op: &'static str, peer: usize) -> Result<()> {
        check::rank(op, "peer", peer, self.size)?;
        if peer == self.rank {
            return Err(Error::Invalid(format!(
                "{op}: peer {peer} is this rank; send and recv need another rank (batch_p2p accepts self-exchange)"
            )));
        }
        Ok(())
    }

    /// A device buffer must live on the communicator's GPU.
    pub(crate) fn device(&self, op: &'static str, buf_device: usize) -> Result<()> {
        if buf_device == self.device {
            Ok(())
        } else {
            Err(Error::Invalid(format!(
                "{op}: the buffer is on device {buf_device} but this communicator runs on device {}",
                self.device
            )))
        }
    }

    /// Dtypes, lengths, roots and reductions of a collective.
    pub(crate) fn collective(
        &self,
        kind: Kind,
        send: Option<(DType, usize)>,
        recv: (DType, usize),
    ) -> Result<()> {
        let op = kind.name();
        check::collective(op, self.size, send, recv)?;
        match kind {
            Kind::AllReduce(r) | Kind::ReduceScatter(r) => self.reduce(op, recv.0, r),
            Kind::Broadcast(root) => check::rank(op, "root", root, self.size),
            Kind::AllGather | Kind::AllToAll => Ok(()),
        }
    }

    /// The checks of a nonblocking request (the same as its blocking form).
    pub(crate) fn request(&self, req: &Request) -> Result<()> {
        let m = |t: &grid_core::Tensor| (t.dtype(), t.len());
        match req {
            Request::AllReduce { buf, op } => {
                self.collective(Kind::AllReduce(*op), Some(m(buf)), m(buf))
            }
            Request::AllReduceInto { send, recv, op } => {
                self.collective(Kind::AllReduce(*op), Some(m(send)), m(recv))
            }
            Request::Broadcast { buf, root } => {
                self.collective(Kind::Broadcast(*root), None, m(buf))
            }
            Request::AllGather { send, recv } => {
                self.collective(Kind::AllGather, Some(m(send)), m(recv))
            }
            Request::ReduceScatter { send, recv, op } => {
                self.collective(Kind::ReduceScatter(*op), Some(m(send)), m(recv))
            }
            Request::AllToAll { send, recv } => {
                self.collective(Kind::AllToAll, Some(m(send)), m(recv))
            }
            Request::Barrier => Ok(()),
            Request::Send { peer, .. } => self.peer("send", *peer),
            Request::Recv { peer, .. } => self.peer("recv", *peer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grid_core::{HostBuffer, Tensor};

    const S: Shape = Shape {
        size: 4,
        rank: 1,
        device: 0,
    };

    fn msg(r: Result<()>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn lengths() {
        assert!(S
            .collective(Kind::AllGather, Some((DType::F32, 2)), (DType::F32, 8))
            .is_ok());
        assert_eq!(
            msg(S.collective(Kind::AllGather, Some((DType::F32, 2)), (DType::F32, 7))),
            "all_gather: recv buffer has 7 elements, expected 8"
        );
        assert_eq!(
            msg(S.collective(
                Kind::ReduceScatter(ReduceOp::Sum),
                Some((DType::F32, 9)),
                (DType::F32, 2)
            )),
            "reduce_scatter: send buffer has 9 elements, expected 8"
        );
        assert_eq!(
            msg(S.collective(
                Kind::AllReduce(ReduceOp::Sum),
                Some((DType::I64, 3)),
                (DType::I64, 4)
            )),
            "all_reduce: recv buffer has 4 elements, expected 3"
        );
        assert_eq!(
            msg(S.collective(Kind::AllToAll, Some((DType::U8, 6)), (DType::U8, 6))),
            "all_to_all: buffer of 6 elements cannot be cut into 4 equal blocks"
        );
    }

    #[test]
    fn dtypes_and_reductions() {
        assert_eq!(
            msg(S.collective(
                Kind::AllReduce(ReduceOp::Sum),
                Some((DType::F32, 2)),
                (DType::BF16, 2)
            )),
            "all_reduce: element types differ: f32 and bf16"
        );
        for d in DType::ALL {
            for r in ReduceOp::ALL {
                let ok = S
                    .collective(Kind::AllReduce(r), Some((d, 4)), (d, 4))
                    .is_ok();
                assert_eq!(ok, r != ReduceOp::Avg || d.is_float(), "{d} {r}");
                assert_eq!(ok, supports(d, Some(r)));
            }
            assert!(supports(d, None));
        }
        assert_eq!(
            msg(S.collective(Kind::ReduceScatter(ReduceOp::Avg), Some((DType::I32, 8)), (DType::I32, 2))),
            "reduce_scatter: the nccl backend does not support Avg on i32 (Avg is for f32, f64, f16 and bf16; for integers use Sum and divide)"
        );
    }

    #[test]
    fn roots_peers_devices() {
        assert_eq!(
            msg(S.collective(Kind::Broadcast(4), None, (DType::F32, 1))),
            "broadcast: root 4 is not a rank of this communicator of size 4 (valid: 0..4)"
        );
        assert!(S.peer("send", 3).is_ok());
        assert_eq!(
            msg(S.peer("send", 9)),
            "send: peer 9 is not a rank of this communicator of size 4 (valid: 0..4)"
        );
        assert_eq!(
            msg(S.peer("recv", 1)),
            "recv: peer 1 is this rank; send and recv need another rank (batch_p2p accepts self-exchange)"
        );
        assert!(S.device("all_reduce", 0).is_ok());
        assert_eq!(
            msg(S.device("all_reduce", 2)),
            "all_reduce: the buffer is on device 2 but this communicator runs on device 0"
        );
    }

    #[test]
    fn requests() {
        let t = |v: Vec<f32>| Tensor::Host(HostBuffer::F32(v));
        assert!(S
            .request(&Request::AllGather {
                send: t(vec![0.0; 2]),
                recv: t(vec![0.0; 8])
            })
            .is_ok());
        assert_eq!(
            msg(S.request(&Request::AllGather {
                send: t(vec![0.0; 2]),
                recv: t(vec![0.0; 6])
            })),
            "all_gather: recv buffer has 6 elements, expected 8"
        );
        assert_eq!(
            msg(S.request(&Request::AllReduce { buf: Tensor::Host(HostBuffer::I64(vec![1])), op: ReduceOp::Avg })),
            "all_reduce: the nccl backend does not support Avg on i64 (Avg is for f32, f64, f16 and bf16; for integers use Sum and divide)"
        );
        assert!(S
            .request(&Request::Broadcast {
                buf: t(vec![1.0]),
                root: 7
            })
            .is_err());
        assert!(S
            .request(&Request::Send {
                buf: t(vec![1.0]),
                peer: 1,
                tag: 0
            })
            .is_err());
        assert!(S
            .request(&Request::Recv {
                buf: t(vec![1.0]),
                peer: 0,
                tag: 0
            })
            .is_ok());
        assert!(S.request(&Request::Barrier).is_ok());
    }
}
