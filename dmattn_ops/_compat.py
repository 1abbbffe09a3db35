"""The private PyTorch names the ops need, imported in one place.

torch.library offers no public way to apply an autograd.Function at one torch.func level from an
Autograd kernel, nor to tell a traced FunctionalTensor from a real one, so these come from
torch's internals. Each is imported here and nowhere else, so that a torch release that moves one
breaks this module (tests/test_packaging.py imports it) rather than a call deep in the ops.
Tested on torch 2.11 (GPU), 2.13.0 and 2.14.1 (CI).

* `SingleLevelFunction`: the base of the Functions functorch itself builds per transform level
  (`torch._functorch.autograd_function.generate_single_level_function`); since torch 2.14 a
  `torch.autograd.Function` subclass applied under a transform always goes back through
  `custom_function_call`, a single-level one does not.
* `enable_single_level_autograd_function`: allows applying such a Function.
* `unwrap_dead_wrappers`: unwraps tensors of exited transforms before a plain apply.
* `FunctionalTensor`: the tensors Inductor's functionalization traces with (no data to read).
"""

from torch._functorch.utils import enable_single_level_autograd_function, unwrap_dead_wrappers
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd.function import _SingleLevelFunction as SingleLevelFunction

__all__ = [
    "FunctionalTensor",
    "SingleLevelFunction",
    "enable_single_level_autograd_function",
    "unwrap_dead_wrappers",
]
