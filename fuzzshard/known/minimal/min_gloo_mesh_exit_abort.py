# for i in $(seq 20); do torchrun --nproc-per-node 2 min_gloo_mesh_exit_abort.py || echo ABORTED; done
# Root cause: a teardown race, not a divergence. The DeviceMesh keeps a reference to the default
# gloo ProcessGroup, so destroy_process_group() does not destroy it (and join its run-loop threads);
# it lives until interpreter finalization. A run-loop thread that is still dropping the finished
# all_reduce's AsyncWork decrefs the input tensor's PyObject, takes the GIL while Python finalizes,
# is pthread_exit-ed inside a noexcept destructor: "terminate called without an active exception",
# SIGABRT. About one exit in four on 2 CPU cores (torch 2.13.0); without the mesh, never.
# Workaround (what fuzzshard's workers and repro scripts do): flush and os._exit() after the verdict.
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
t = torch.ones(2)
dist.all_reduce(t)
dist.destroy_process_group()
if "--workaround" in sys.argv:
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
