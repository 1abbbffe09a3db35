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
* `FunctionalTensor`, `FakeTensor`, `is_fake`: the tensors tracing uses (no data to read).
* `functorch`: functorch's C module (wrapper levels: is_functorch_wrapped_tensor, get_unwrapped,
  ...) and `transforms_active()`.
* `below_autograd()` and `AFTER_AUTOGRAD_KEYSET`: the redispatch below Autograd that an Autograd
  kernel registered by hand does when nothing needs a gradient (as torch's own custom ops do).
* `without_autocast(device_type)`: leaves the Autocast key of a device for the ops below.
* `fused_sdp_choice`: which fused kernel `scaled_dot_product_attention` would pick;
  `sdp_priority_order()`: the order it tries them in (`sdpa_kernel(..., set_priority=True)`
  changes it; () where torch has no such order).
* `plain_eager(tensors)`: no torch.func transform, no dispatch or function mode (fake tensors,
  a compiled graph's trace, opcheck, FlopCounterMode) and no tensor subclass: an Autograd
  kernel may then run the kernel below it itself. `saved_tensor_hooks_active()`: activation
  checkpointing or offloading decides what the autograd graph keeps.

registration/inductor.py, an Inductor lowering by nature, imports Inductor's modules itself.
"""

import torch
from torch._functorch.utils import enable_single_level_autograd_function, unwrap_dead_wrappers
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd.function import _SingleLevelFunction as SingleLevelFunction

functorch = torch._C._functorch
transforms_active = torch._C._are_functorch_transforms_active
below_autograd = torch._C._AutoDispatchBelowAutograd
AFTER_AUTOGRAD_KEYSET = torch._C._after_autograd_keyset
fused_sdp_choice = torch._fused_sdp_choice


def sdp_priority_order() -> tuple:
    """The order in which scaled_dot_product_attention tries its backends (SDPBackend values),
    as `sdpa_kernel(..., set_priority=True)` sets it; () on a torch without such an order."""
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return () if order is None else tuple(order())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(tensors) -> bool:
    return (
        not transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and all(t is None or type(t) in _PLAIN for t in tensors)
    )


def saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def without_autocast(device_type: str):
    """A guard that excludes the Autocast dispatch key of `device_type` ("cpu", "cuda")."""
    key = getattr(torch._C.DispatchKey, "Autocast" + device_type.upper())
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key))


__all__ = [
    "AFTER_AUTOGRAD_KEYSET",
    "FakeTensor",
    "FunctionalTensor",
    "SingleLevelFunction",
    "below_autograd",
    "enable_single_level_autograd_function",
    "functorch",
    "fused_sdp_choice",
    "is_fake",
    "plain_eager",
    "saved_tensor_hooks_active",
    "sdp_priority_order",
    "transforms_active",
    "unwrap_dead_wrappers",
    "without_autocast",
]
