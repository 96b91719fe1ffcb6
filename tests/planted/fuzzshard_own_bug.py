"""Planted bug in fuzzshard itself, not in torch: the kernel's batched gather
loses a module it calls (as fuzzshard's code would call an API this torch
lacks). The AttributeError is raised in fuzzshard's own code: an internal
error, never a torch finding."""
import fuzzshard.kernel.gather as gather

gather.math = None
