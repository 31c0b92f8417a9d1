"""The command loop the peer scripts share with this project's `peer-bench` example.

Every rank connects to the driver's Unix socket (`cargo xtask bench peers`), says
`hello RANK SIZE`, and answers one line per command:

* `run OP BYTES WARMUP ITERS`: WARMUP untimed calls, then ITERS timed ones, each after a
  barrier; the answer is `ok T1 T2 ...` (seconds per timed call on this rank) or
  `err MESSAGE`.
* `quit`: the rank ends.

OP and the buffer shapes follow nccl-tests, exactly as `peer-bench` does: all_reduce and
broadcast move BYTES, all_gather gathers BYTES in all, reduce_scatter reduces BYTES in all;
f32, sum; every rank contributes rank + 1 (its rank for all_gather), and the last call's
result is checked.
"""

import socket
import sys
import time

OPS = (
    "all_reduce",
    "all_reduce_in_place",
    "all_gather",
    "all_gather_in_place",
    "reduce_scatter",
    "reduce_scatter_in_place",
    "broadcast",
    "groups",
    "groups_local",
)


def shape(op, nbytes, n):
    """(send elements, receive elements) of f32 buffers, as grid_programs::collectives::Op::shape."""
    elems = max(nbytes // 4, 1)
    block = max(elems // n, 1)
    if op in ("all_reduce", "all_reduce_in_place", "broadcast"):
        return elems, elems
    if op in ("all_gather", "all_gather_in_place"):
        return block, block * n
    return block * n, block


def expected(op, n):
    """The value every element of the result holds (all_gather: element i holds i // block)."""
    if op == "broadcast":
        return 1.0
    return float(n * (n + 1) // 2)


def timed(barrier, call, prepare, warmup, iters):
    """WARMUP + ITERS calls, each after prepare() and a barrier; the timed calls' seconds."""
    times = []
    for it in range(warmup + iters):
        prepare()
        barrier()
        t = time.perf_counter()
        call()
        dt = time.perf_counter() - t
        if it >= warmup:
            times.append(dt)
    return times


def serve(path, rank, size, run):
    """Answers the driver's commands; run(op, nbytes, warmup, iters) returns the seconds."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    f = s.makefile("rw", buffering=1)
    f.write(f"hello {rank} {size}\n")
    for line in f:
        words = line.split()
        if words == ["quit"]:
            return
        try:
            if len(words) != 5 or words[0] != "run" or words[1] not in OPS:
                raise ValueError(f"unknown command {line.strip()!r}")
            nbytes, warmup, iters = (int(w) for w in words[2:])
            times = run(words[1], nbytes, warmup, iters)
            f.write("ok " + " ".join(f"{t:e}" for t in times) + "\n")
        except Exception as e:  # the driver reports it; this rank goes on
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            f.write(f"err rank {rank}: {msg}\n")


def arg(name, default=None):
    """The value after `name` on the command line."""
    if name in sys.argv:
        return sys.argv[sys.argv.index(name) + 1]
    if default is None:
        sys.exit(f"{sys.argv[0]}: {name} is required")
    return default
