# python min_compile_composable_checkpoint_grads.py
# torch.compile of a module (module.compile(), as torchtitan compiles each block) holding a submodule under the
# composable activation checkpoint (torch.distributed._composable.checkpoint, which FSDP2 users pair with
# fully_shard): the grads that flow back out of the compiled block are wrong, silently. Here the checkpointed
# LayerNorm sits first in the block and the embedding in front of the block gets a wrong grad; eager, or the
# same block compiled without the checkpoint, matches. (Checkpointing a Linear there instead raises: an inductor
# stride assertion, or CheckpointError "Recomputed values ... have different metadata".) No process group needed.
import sys, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
from torch.distributed._composable import checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(6), nn.Linear(6, 6, bias=False)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.block, self.head = nn.Embedding(7, 6), Block(), nn.Linear(6, 7, bias=False)

    def forward(self, tokens):
        return self.head(self.block(self.emb(tokens)))


torch.manual_seed(0)
eager, compiled = Net(), Net()
compiled.load_state_dict(eager.state_dict())
checkpoint(compiled.block.norm)
compiled.block.compile()
x, y = torch.randint(0, 7, (2, 3)), torch.randint(0, 7, (2, 3))
for m in (eager, compiled):
    F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
worst = max(((a.grad - b.grad).abs().max().item(), n) for (n, a), b in zip(compiled.named_parameters(), eager.parameters()))
bad = worst[0] > 1e-5
print(f"compiled block with a checkpointed LayerNorm vs eager: max |grad diff| = {worst[0]:.3g} ({worst[1]})")
print("BUG REPRODUCED" if bad else "ok")
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
