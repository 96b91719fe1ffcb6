"""The checkpoint kinds of torch.distributed.checkpoint's state-dict API (dtensor,
fsdp2 and fsdp1 take them): "full" (a full state dict, torch.save on rank 0,
torch.load on every loading rank), "broadcast" (the same file read by rank 0
only, ``broadcast_from_rank0=True``) and "dcp" (a sharded state dict through
``dcp.save`` / ``dcp.load``, or ``dcp.async_save`` with training going on while
it runs: ``Checkpoint.async_save``), as kernel/state_io.py runs them."""
from __future__ import annotations

from ..case import Case

KINDS = ("full", "broadcast", "dcp")


def imports(case: Case) -> list[str]:
    ck = case.checkpoint
    names = ["StateDictOptions", "get_state_dict"] + (["set_model_state_dict", "set_optimizer_state_dict"]
                                                      if ck.split else ["set_state_dict"])
    out = [f"from torch.distributed.checkpoint.state_dict import {', '.join(names)}"]
    if ck.async_save in ("stager", "pinned"):
        out.append("from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions")
    return (["import torch.distributed.checkpoint as dcp"] if ck.kind == "dcp" else []) + out


def save(case: Case, group: str) -> list[str]:
    pg = f", process_group={group}" if group else ""
    if case.checkpoint.kind == "dcp" and case.checkpoint.async_save:
        return async_save(case, pg)
    if case.checkpoint.kind == "dcp":
        return ["msd, osd = get_state_dict(model, opt)",
                f"dcp.save({{\"model\": msd, \"optim\": osd}}, storage_writer=dcp.FileSystemWriter(ckpt){pg})"]
    return ["msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))",
            "if rank == 0:", "    torch.save({\"model\": msd, \"optim\": osd}, f\"{ckpt}/full.pt\")"]


def missing_keys(case: Case) -> list[str]:
    """Every state-dict key of the params the loaded model state dict lacks (a tied param's too)."""
    missing = list(case.checkpoint.missing)
    if case.model.tie_head and "layers.0.weight" in missing:
        missing.append("head.weight")
    return missing


def load(case: Case, group: str) -> list[str]:
    ck = case.checkpoint
    missing = missing_keys(case)
    opts = ["full_state_dict=True"] * (ck.kind != "dcp") + ["broadcast_from_rank0=True"] * (ck.kind == "broadcast") \
        + ["strict=False"] * (not ck.strict)
    out = []
    if ck.kind == "dcp":
        pg = f", process_group={group}" if group else ""
        out += ["msd, osd = get_state_dict(model, opt)  # the sharded layout to load into",
                "sd = {\"model\": msd, \"optim\": osd}",
                f"dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt){pg})"]
    elif ck.kind == "broadcast":
        out.append("sd = torch.load(f\"{ckpt}/full.pt\") if rank == 0 else {\"model\": {}, \"optim\": {}}  # rank 0 reads it")
    else:
        out.append("sd = torch.load(f\"{ckpt}/full.pt\")")
    cond = "if sd[\"model\"]:  # (not on ranks that get it broadcast)\n    " if ck.kind == "broadcast" else ""
    if missing:
        out += (cond + f"sd[\"model\"] = {{k: v for k, v in sd[\"model\"].items() if k not in {missing!r}}}  "
                "# the model state dict lacks these").split("\n")
    if ck.unexpected:
        out += (cond + "sd[\"model\"][\"fuzzshard_unexpected.weight\"] = torch.zeros(2)  # a key the model has not").split("\n")
    options = f", options=StateDictOptions({', '.join(opts)})" if opts else ""
    if ck.split:
        out += [f"set_model_state_dict(model, sd[\"model\"]{options})",
                f"set_optimizer_state_dict(model, opt, sd[\"optim\"]{options})"]
    else:
        out.append(f"set_state_dict(model, opt, model_state_dict=sd[\"model\"], optim_state_dict=sd[\"optim\"]{options})")
    return out


# training going on while an async save runs: every tensor the saved state dict holds changed in place (as this
# rank stores it: a DTensor's local tensor, a ShardedTensor's local shards), and put back once the save is done
_GOES_ON = """def local_tensors(x):  # the tensors a state dict holds, as this rank stores them
    if isinstance(x, dict):
        return [t for v in x.values() for t in local_tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in local_tensors(v)]
    if hasattr(x, "local_shards"):  # a ShardedTensor
        return [s.tensor for s in x.local_shards()]
    return [getattr(x, "_local_tensor", x)] if isinstance(x, torch.Tensor) and x.numel() else []

@torch.no_grad()
def training_goes_on(sd):  # a step changes the saved tensors in place; returns what puts them back
    live = local_tensors(sd)
    before = [t.clone() for t in live]
    for t in live:
        t.logical_not_() if t.dtype == torch.bool else t.add_(1)
    return torch.no_grad()(lambda: [t.copy_(b) for t, b in zip(live, before)])"""


def async_save(case: Case, pg: str, make: list[str] | None = None) -> list[str]:
    """``dcp.async_save`` as kernel/state_io.py's dcp_save calls it, training going on until the upload is done
    (``make``: the lines that leave the state dict ``sd``, a writer's own; else DSD's of the model)."""
    how = case.checkpoint.async_save
    out = _GOES_ON.split("\n") + [""] + (make or ["msd, osd = get_state_dict(model, opt)", "sd = {\"model\": msd, \"optim\": osd}"])
    if how == "thread":
        return out + [f"response = dcp.async_save(sd, checkpoint_id=ckpt{pg})  # staged on CPU in the call, "
                      "uploaded on a thread",
                      "restore = training_goes_on(sd)  # while the save runs",
                      "response.result()  # the upload is done",
                      "restore()"]
    if how == "writer":
        return out + [f"response = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(ckpt){pg})  # the writer "
                      "stages a CPU copy in the call, the upload on a thread",
                      "restore = training_goes_on(sd)  # while the save runs",
                      "response.result()  # the upload is done",
                      "restore()"]
    pinned = how == "pinned"
    blocking = case.device != "cpu"  # (a non-blocking copy needs an accelerator)
    return out + [
        f"stager = DefaultStager(StagingOptions(use_pinned_memory={pinned}, use_shared_memory={pinned}, "
        f"use_async_staging=True, use_non_blocking_copy={blocking}))  # kept over saves, as torchtitan keeps it",
        "# an earlier save through the same stager, of other values (a loop that saves every few steps)",
        "restore = training_goes_on(sd)",
        f"response = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(f\"{{ckpt}}/earlier\"), "
        f"async_stager=stager{pg})",
        "response.staging_completion.result()",
        "restore()",
        "response.upload_completion.result()",
        "# the checkpoint, through the same stager",
        f"response = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(ckpt), async_stager=stager{pg})",
        "response.staging_completion.result()  # torchtitan waits for this before the next optimizer step",
        "restore = training_goes_on(sd)  # while the upload runs",
        "response.upload_completion.result()",
        "restore()",
        "stager.close()"]
