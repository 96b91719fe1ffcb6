# torchrun --nproc-per-node 1 min_pp_tie_stages_scale_grads.py
# A weight tied between two stage modules of one rank (ScheduleDualPipeV puts the first and the last stage on
# rank 0: the embedding and the head, so that the tie needs no communication), scale_grads=True, 2 microbatches:
# each stage's scale_grads divides its own submod.parameters()' grads by n_microbatches when that stage's
# backward is done (torch/distributed/pipelining/stage.py), so the shared weight is divided once per stage: what
# it accumulated before the first of the two divisions is divided twice (here all of it: half the right grad).
# Silent. scale_grads=False with the grads divided by hand is right, and so is the same pipeline untied.
import sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(2, 2), nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter in two modules
    def forward(self, x):
        return self.head(self.mid(self.emb(x)))

g = torch.Generator().manual_seed(0)
x, y = torch.randint(0, 2, (2, 1), generator=g), torch.randn(2, 1, 2, generator=g)
loss_fn = lambda out, target: ((out - target) ** 2).mean()
torch.manual_seed(0)
want = Net()
(sum(loss_fn(want(xm), ym) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2))) / 2).backward()

torch.manual_seed(0)
net = Net()
stages = [PipelineStage(net.emb, 0, 2, torch.device("cpu")),                     # stage 0 on rank 0
          PipelineStage(nn.Sequential(net.mid, net.head), 1, 2, torch.device("cpu"))]  # stage 1 on rank 0 too (V)
ScheduleDualPipeV(stages, n_microbatches=2, loss_fn=loss_fn, scale_grads=True).step(x, target=y)
got, right = net.emb.weight.grad, want.emb.weight.grad
bad = not torch.allclose(got, right, atol=1e-6)
if rank == 0:
    print("tied weight's grad, pipelined:", got.flatten().tolist())
    print("tied weight's grad, plain:    ", right.flatten().tolist())
    print("mid weight's grad equal:", torch.allclose(net.mid.weight.grad, want.mid.weight.grad, atol=1e-6))
    print("BUG REPRODUCED" if bad else "ok")
dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
