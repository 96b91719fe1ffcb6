"""The TCPStore a soak's processes meet in (torchrun's own), seen under a
prefix. Its own module so that a worker (worker.py) reaches it without
importing span.py, which starts workers: the driver's modules import the
worker side, never the reverse."""
from __future__ import annotations

from datetime import timedelta


def open_store(where: dict, timeout: float = 120.0, is_master: bool = False):
    """The store at ``where`` (host, port), seen under its prefix."""
    import torch.distributed as dist

    base = dist.TCPStore(where["host"], where["port"], is_master=is_master, timeout=timedelta(seconds=timeout),
                         multi_tenant=True, wait_for_workers=False)
    return dist.PrefixStore(where["prefix"], base)
