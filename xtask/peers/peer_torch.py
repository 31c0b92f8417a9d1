"""torch.distributed Gloo's side of `cargo xtask bench peers`: see common.py for the commands.

    peer_torch.py --connect SOCKET --rank R --world-size N --store FILE [--groups JSON]

all_reduce (out of place): torch has no out-of-place all-reduce, so `recv.copy_(send)` then
`all_reduce(recv)` (what a caller who keeps its input writes); all_reduce_in_place:
`all_reduce(buf)`, the buffer refilled before every call (outside the timing); all_gather:
`all_gather_into_tensor`; reduce_scatter: `reduce_scatter_tensor`; broadcast: from rank 0.
groups: `new_group(ranks)` for every group of every family in the JSON file (global: every rank
takes part in every call, as Megatron-Core does); groups_local: with
`use_local_synchronization=True`, every distinct group once (see new_groups). The groups are
destroyed after each timed call.
"""

import json

import torch
import torch.distributed as dist

import common


def main():
    rank, n = int(common.arg("--rank")), int(common.arg("--world-size"))
    dist.init_process_group(
        "gloo", init_method="file://" + common.arg("--store"), rank=rank, world_size=n
    )
    groups_file = common.arg("--groups", "")
    families = []
    if groups_file:
        with open(groups_file) as f:
            families = json.load(f)["families"]

    def run(op, nbytes, warmup, iters):
        if op in ("groups", "groups_local"):
            return new_groups(families, op == "groups_local", warmup, iters)
        send_len, recv_len = common.shape(op, nbytes, n)
        value = float(rank) if op == "all_gather" else float(rank + 1)
        send = torch.full((send_len,), value, dtype=torch.float32)
        recv = torch.zeros(recv_len, dtype=torch.float32)
        prepare = lambda: None
        if op == "all_reduce":
            call = lambda: (recv.copy_(send), dist.all_reduce(recv))
        elif op == "all_reduce_in_place":
            prepare = lambda: recv.copy_(send)
            call = lambda: dist.all_reduce(recv)
        elif op == "all_gather":
            call = lambda: dist.all_gather_into_tensor(recv, send)
        elif op == "reduce_scatter":
            call = lambda: dist.reduce_scatter_tensor(recv, send)
        else:
            prepare = lambda: recv.copy_(send)
            call = lambda: dist.broadcast(recv, 0)
        times = common.timed(dist.barrier, call, prepare, warmup, iters)
        check(op, send_len, recv, n)
        return times

    try:
        common.serve(common.arg("--connect"), rank, n, run)
    finally:
        dist.destroy_process_group()


def new_groups(families, local, warmup, iters):
    if not families:
        raise ValueError("groups: no --groups file")
    made = []
    # With use_local_synchronization=True, torch 2.15.0 hangs when the same rank list is
    # created a second time (families share groups: ep and tp_ep, for example), so that mode
    # creates each distinct group once; the global mode creates every group of every family.
    lists = [ranks for fam in families for ranks in fam["groups"]]
    if local:
        distinct = []
        for ranks in lists:
            if ranks not in distinct:
                distinct.append(ranks)
        lists = distinct

    def call():
        for ranks in lists:
            made.append(dist.new_group(ranks, backend="gloo", use_local_synchronization=local))

    def prepare():
        for g in made:
            if isinstance(g, dist.ProcessGroup):
                dist.destroy_process_group(g)
        made.clear()

    times = common.timed(dist.barrier, call, prepare, warmup, iters)
    prepare()
    return times


def check(op, send_len, recv, n):
    if op == "all_gather":
        want = torch.div(torch.arange(recv.numel()), send_len, rounding_mode="floor").float()
    else:
        want = torch.full((recv.numel(),), common.expected(op, n), dtype=torch.float32)
    bad = torch.nonzero(recv != want)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{op}: wrong result: element {i} of {recv.numel()} is {recv[i].item()}")


if __name__ == "__main__":
    main()
