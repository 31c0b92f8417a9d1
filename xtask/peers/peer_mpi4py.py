"""mpi4py's side of `cargo xtask bench peers` (under mpirun): see common.py for the commands.

all_reduce: Allreduce(send, recv); all_reduce_in_place: Allreduce(MPI.IN_PLACE, buf), the buffer
refilled before every call (outside the timing); all_gather: Allgather; reduce_scatter:
Reduce_scatter_block; all_gather_in_place: Allgather(MPI.IN_PLACE, buf) on one buffer of
size · block elements whose own block holds this rank's values; reduce_scatter_in_place:
Reduce_scatter_block(MPI.IN_PLACE, buf), buf refilled before every call (outside the timing),
the result at the start of buf (MPI's convention); broadcast: Bcast from rank 0. numpy float32
buffers (the buffer protocol: no copies in mpi4py), with numpy's default memory: huge pages
advised from 4 MiB, which peer-bench's MPI side copies (docs/performance.md).
"""

import numpy as np
from mpi4py import MPI

import common


def main():
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def run(op, nbytes, warmup, iters):
        if op == "groups":
            raise ValueError("groups: mpi4py is not measured for group creation")
        send_len, recv_len = common.shape(op, nbytes, n)
        value = float(rank) if op in ("all_gather", "all_gather_in_place") else float(rank + 1)
        send = np.full(send_len, value, dtype=np.float32)
        recv = np.zeros(recv_len, dtype=np.float32)
        prepare = lambda: None
        if op == "all_reduce":
            call = lambda: comm.Allreduce(send, recv, op=MPI.SUM)
        elif op == "all_reduce_in_place":
            prepare = lambda: np.copyto(recv, send)
            call = lambda: comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM)
        elif op == "all_gather":
            call = lambda: comm.Allgather(send, recv)
        elif op == "reduce_scatter":
            call = lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
        elif op == "all_gather_in_place":
            whole = recv
            prepare = lambda: whole[rank * send_len:(rank + 1) * send_len].fill(value)
            call = lambda: comm.Allgather(MPI.IN_PLACE, whole)
        elif op == "reduce_scatter_in_place":
            whole = np.zeros(send_len, dtype=np.float32)
            prepare = lambda: whole.fill(value)
            call = lambda: comm.Reduce_scatter_block(MPI.IN_PLACE, whole, op=MPI.SUM)
        else:
            prepare = lambda: np.copyto(recv, send)
            call = lambda: comm.Bcast(recv, root=0)
        times = common.timed(comm.Barrier, call, prepare, warmup, iters)
        if op == "reduce_scatter_in_place":
            recv[:] = whole[:recv_len]
        check(op, send_len, recv, n)
        return times

    common.serve(common.arg("--connect"), rank, n, run)


def check(op, send_len, recv, n):
    if op in ("all_gather", "all_gather_in_place"):
        want = (np.arange(recv.size) // send_len).astype(np.float32)
    else:
        want = np.full(recv.size, common.expected(op, n), dtype=np.float32)
    bad = np.flatnonzero(recv != want)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: wrong result: element {i} of {recv.size} is {recv[i]}")


if __name__ == "__main__":
    main()
