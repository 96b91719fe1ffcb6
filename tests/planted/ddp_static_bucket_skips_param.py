"""Planted bug: under static_graph, after the first iteration (when DDP has
rebuilt its buckets), the first bucket skips its first param: that param's
slice keeps this rank's own grad, never averaged. Emulated as a comm hook in
front of whatever averages the buckets (DDP's default all-reduce, or the hook
a user registers later, which becomes the inner one)."""
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

_init, _register = DDP.__init__, DDP.register_comm_hook


def __init__(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if not self.static_graph:
        return
    self._planted_iter, self._planted_inner = 0, (None, lambda state, bucket: allreduce_hook(self.process_group, bucket))

    def hook(_, bucket):
        it = self._planted_iter
        if bucket.is_last():
            self._planted_iter += 1
        state, inner = self._planted_inner
        if it == 0 or bucket.index() != 0:
            return inner(state, bucket)
        own = bucket.gradients()[0].detach().clone().flatten()  # this rank's grad, before any averaging
        fut = inner(state, bucket)

        def skip(done):
            value = done.value()
            buf = value[0] if isinstance(value, list) else value
            buf[:own.numel()].copy_(own)
            return buf

        return fut.then(skip)

    _register(self, None, hook)


def register_comm_hook(self, state, hook):
    if getattr(self, "_planted_inner", None) is not None:
        self._planted_inner = (state, hook)
        return
    return _register(self, state, hook)


DDP.__init__, DDP.register_comm_hook = __init__, register_comm_hook
