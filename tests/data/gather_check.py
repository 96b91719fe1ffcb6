"""Under torchrun: full copies gathered in one batch (kernel/gather.py) equal
full_tensor() bit for bit, over random shapes, shard dims and dtypes (uneven
and empty shards included); a rank whose shard is not what its spec says
falls back to full_tensor() on every rank, in order; the replica oracle's
pass names a copy that drifted on one rank, and a value one rank lacks. Prints
OK on success."""
import os
import random
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fuzzshard.kernel.gather import full_batched, gather_batch, owned_copy, replica_mismatches


def raw(t):
    return t if t.dtype == torch.bool else t.contiguous().reshape(-1).view(torch.uint8)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rng = random.Random(0)
    torch.manual_seed(0)
    batched = 0
    for _ in range(30):
        ts = []
        for _ in range(rng.randint(1, 6)):
            nd = rng.randint(1, 3)
            shape = [rng.randint(0, 5) for _ in range(nd)]
            dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool])
            placement = rng.choice([Shard(rng.randrange(nd)), Replicate()])
            ts.append(distribute_tensor((torch.randn(shape) * 10).to(dtype), mesh, [placement]))
        with gather_batch():
            got = [owned_copy(full_batched(t, DTensor.full_tensor)) for t in ts]
            batched += sum(g is not t for g, t in zip(got, ts) if isinstance(t.placements[0], Shard))
        for t, g in zip(ts, got):
            want = t.full_tensor()
            assert g.dtype == want.dtype and g.shape == want.shape and torch.equal(raw(g), raw(want)), (t.placements, t.shape)
    assert batched > 30, batched
    # a shard that is not what its spec says (rank 1's is a row short): every rank gathers it on its own
    # (full_tensor() there; a stand-in here, which would not survive the mismatch), in its place in order
    full = torch.arange(12.0).view(4, 3)
    local = full.chunk(2)[min(dist.get_rank(), 1)]
    if dist.get_rank() == 1:
        local = local[:-1]
    odd = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    good = distribute_tensor(full * 2, mesh, [Shard(0)])
    fell_back = []

    def stand_in(t):
        fell_back.append(t is odd)
        return torch.full((5,), 7.0)

    with gather_batch():
        got = [full_batched(t, stand_in) for t in (good, odd, good)]
    assert fell_back == [True], fell_back
    assert torch.equal(got[0], full * 2) and torch.equal(got[2], full * 2)
    assert torch.equal(got[1], torch.full((5,), 7.0)), got[1]
    replicas(mesh)
    print("OK", flush=True)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # a DeviceMesh keeps gloo alive past destroy: finalizing may abort (known/minimal/min_gloo_mesh_exit_abort.py)


def replicas(mesh):
    """The replica oracle's pass: every rank's copies compared, the batched
    ones left out; a drift on one rank named with the ranks holding each copy
    (on rank 0 only); a value one rank lacks found without a hang."""
    rank, n = dist.get_rank(), dist.get_world_size()
    w = torch.arange(12.0).view(4, 3)
    rep = distribute_tensor(w, mesh, [Replicate()])
    shard = distribute_tensor(w, mesh, [Shard(0)])
    with gather_batch() as b:
        obs = {"params": {"a": owned_copy(full_batched(rep, DTensor.full_tensor)),
                          "b": owned_copy(full_batched(shard, DTensor.full_tensor))},
               "state": {"a": {"step": torch.tensor(1.0)}}, "groups": [{"lr": 0.1}]}
        same = b.watch(obs)
    assert same == [] and id(obs["params"]["b"]) in b.everywhere and id(obs["params"]["a"]) not in b.everywhere
    drifted = w.clone()
    if rank == n - 1:
        drifted[2, 1] = torch.nextafter(drifted[2, 1], torch.tensor(100.0))
    got = replica_mismatches({"params": {"a": drifted}, "groups": [{"lr": 0.1 if rank else 0.2}]})
    if rank == 0:
        assert [(m["quantity"], m["fqn"]) for m in got] == [("param", "a"), ("param_groups.lr", "group 0")], got
        assert got[0]["ranks"] == [n - 1] and got[0]["at"] == (2, 1) and got[0]["replicas"] == [list(range(n - 1)), [n - 1]]
        assert got[1]["replicas"] == [[0], list(range(1, n))]
    else:
        assert got == []
    with gather_batch() as b:  # the same, its summary riding in the batch's own all-gather
        carried = b.watch({"params": {"a": drifted, "b": owned_copy(full_batched(shard, DTensor.full_tensor))}})
    assert [(m["quantity"], m["ranks"]) for m in carried] == ([("param", [n - 1])] if rank == 0 else []), carried
    lacking = {"state": {"a": {"exp_avg": w}} if rank else {"a": {}}}  # rank 0 lacks it: other names, other lengths
    got = replica_mismatches(lacking)
    if rank == 0:
        assert [(m["quantity"], m.get("presence")) for m in got] == [("state.exp_avg", "appeared")], got


if __name__ == "__main__":
    main()
