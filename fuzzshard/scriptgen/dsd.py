"""The checkpoint kinds of torch.distributed.checkpoint's state-dict API (dtensor,
fsdp2 and fsdp1 take them): "full" (a full state dict, torch.save on rank 0,
torch.load on every loading rank), "broadcast" (the same file read by rank 0
only, ``broadcast_from_rank0=True``) and "dcp" (a sharded state dict through
``dcp.save`` / ``dcp.load``), as kernel/state_io.py runs them."""
from __future__ import annotations

from ..case import Case

KINDS = ("full", "broadcast", "dcp")


def imports(case: Case) -> list[str]:
    ck = case.checkpoint
    names = ["StateDictOptions", "get_state_dict"] + (["set_model_state_dict", "set_optimizer_state_dict"]
                                                      if ck.split else ["set_state_dict"])
    out = [f"from torch.distributed.checkpoint.state_dict import {', '.join(names)}"]
    return (["import torch.distributed.checkpoint as dcp"] if ck.kind == "dcp" else []) + out


def save(case: Case, group: str) -> list[str]:
    pg = f", process_group={group}" if group else ""
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
