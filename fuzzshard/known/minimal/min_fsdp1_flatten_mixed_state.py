# torchrun --nproc-per-node 1 min_fsdp1_flatten_mixed_state.py
# FSDP.optim_state_dict_to_load (use_orig_params=False) into a model wrapped differently from the saving one: a
# new FlatParameter gathers params whose saved state differs (one never got a grad: no state, or Adagrad's step 0
# next to step 1). _flatten_optim_state must invent one state for the whole FlatParameter: tensor states are
# zero-filled for the params without state (silent: the loaded optimizer holds state the saved one never had, and
# SGD with dampening then steps such a param other than plain torch.optim does), 0-d states that differ are
# refused with a ValueError. Plain optimizer.load_state_dict takes the same state dict as is.
import sys, warnings, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullStateDictConfig, FullOptimStateDictConfig
from torch.distributed.fsdp.wrap import CustomPolicy
warnings.filterwarnings("ignore"); torch.set_num_threads(1)
dist.init_process_group("gloo"); rank = dist.get_rank()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.use_b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), False
    def forward(self, x):
        return self.b(self.a(x)) if self.use_b else self.a(x)   # b gets no grad until use_b

def fsdp(wrap_a, make_opt):   # wrap_a: a in its own unit, b alone in the root's FlatParameter
    torch.manual_seed(0); net = Net()
    m = FSDP(net, use_orig_params=False, device_id=torch.device("cpu"),
             auto_wrap_policy=CustomPolicy(lambda mod: wrap_a and mod is net.a))
    # offload_to_cpu=False: on CPU the default True aliases a param's states (another known bug)
    FSDP.set_state_dict_type(m, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                             FullOptimStateDictConfig(offload_to_cpu=False))
    return m, make_opt(m.parameters())

def step(model, opt, x):
    opt.zero_grad(); model(x).sum().backward(); opt.step()

torch.manual_seed(1); x = torch.randn(4, 2)   # the same batch on every rank
sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5)
src, opt = fsdp(True, sgd)
step(src, opt, x)                           # b unused: no momentum_buffer for b.*
saved = FSDP.optim_state_dict(src, opt)     # keyed by FQN: a.weight, a.bias only
has_state = sorted(n for n, st in saved["state"].items() if st)
dst, opt2 = fsdp(False, sgd)                # one FlatParameter: a.*, b.*
opt2.load_state_dict(FSDP.optim_state_dict_to_load(dst, opt2, saved))
invented = sorted(n for n, s in FSDP.optim_state_dict(dst, opt2)["state"].items() if n not in saved["state"] and s)
torch.manual_seed(0); ref = Net()            # plain torch: the same state dict, keyed by param id
opt_ref = sgd(ref.parameters())
opt_ref.load_state_dict(FSDP.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_ID, ref, optim=opt_ref))
for m, o in ((ref, opt_ref), (dst, opt2)):  # b used now: its first momentum step
    getattr(m, "module", m).use_b = True
    step(m, o, x)
with FSDP.summon_full_params(dst):
    diff = (dst.b.weight - ref.b.weight).abs().max().item()

ada = lambda ps: torch.optim.Adagrad(ps, lr=0.1)   # state from its constructor: step 0 for b, 1 for a
src, opt = fsdp(True, ada)
step(src, opt, x)
saved = FSDP.optim_state_dict(src, opt)
dst, opt2 = fsdp(False, ada)
try:
    FSDP.optim_state_dict_to_load(dst, opt2, saved)
    refused = ""
except ValueError as e:
    refused = str(e)

bad = bool(invented) or diff > 1e-6 or bool(refused)
if rank == 0:
    print("SGD: saved state for", has_state)
    print("SGD: loaded state invented for", invented, "(zero momentum_buffer)")
    print("SGD(dampening=0.5): b.weight after its first step, max |FSDP1 - plain| = %.3g" % diff)
    print("Adagrad: optim_state_dict_to_load raises:", refused[:160] or "nothing")
    print("BUG REPRODUCED" if bad else "ok")
dist.barrier(); dist.destroy_process_group()
sys.exit(1 if bad else 0)   # exit 1: bug reproduced
