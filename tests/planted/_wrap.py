"""Shared by the planted bugs: wrap every torch.optim optimizer's step()."""
import torch

OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "NAdam", "RAdam", "Adamax", "ASGD",
              "Rprop", "Adafactor"]


def wrap_steps(make_step):
    for name in OPTIMIZERS:
        cls = getattr(torch.optim, name, None)
        if cls is not None and not getattr(cls.step, "_planted", False):
            cls.step = make_step(cls.step)
            cls.step._planted = True
