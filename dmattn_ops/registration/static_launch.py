"""Inductor's static launcher for our kernels, turned on when a compiled graph first meets them.

Inductor launches user-defined Triton kernels through Triton's own Python launcher unless
``torch._inductor.config.static_launch_user_defined_triton_kernels`` is on; with it, through its
static launcher, a few microseconds per launch. On the H100 that is the difference between a
slower and a faster model step (B4 L2048 DMA step 17.4 ms with Triton's launcher, 10.3 ms with
the static one, 15.9 ms with the ops whole). So the first trace of one of our ops on CUDA
tensors turns that option on, unless the user set it (in code or through its environment
variable TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS); kernels the static launcher
cannot take fall back to Triton's launcher by Inductor's own rule. `import dmattn_ops` changes
nothing (SPEC).

When: in our fake kernels, which Dynamo runs while it traces the model, before Inductor starts
its compile workers and before AOTAutograd looks in its caches; a graph loaded from those caches
is never traced by AOTAutograd again, but Dynamo's trace still runs our fake kernels first, and
the option is read when the graph's kernels load. Both the option and its environment
variable: Inductor compiles kernels in worker processes, which are told
`use_static_triton_launcher` but not this option (torch 2.11, _inductor/async_compile.py) and
read it from the environment they inherit. Workers started before (a model without our ops
compiled earlier in the process) would keep their old setting and compile our kernels for
Triton's launcher, whatever the option says in this process: the B16 L512 DMA step of
`bench.model` took 6.63 ms that way, after the dense model compiled first, against 5.64-5.93 ms
in a fresh process (H100, torch 2.11), its host time 6.9 ms against 4.0-4.6 per step. So when
it turns the option on, this also shuts down a compile-worker pool that is already running;
Inductor starts a new one, with the variable in its environment, at its next compile. To opt
out, set the variable to 0 or the option to False: Inductor reads that variable as a forced
value, and nothing here then runs.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
OPTION = "static_launch_user_defined_triton_kernels"
VARIABLE = "TORCHINDUCTOR_" + OPTION.upper()
_DONE = False


def launch_statically() -> None:
    """Turns on Inductor's static launcher for user-defined Triton kernels, unless the user
    chose (module docstring). Cheap after the first call."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    from torch._inductor import config

    if getattr(config, OPTION, True) or VARIABLE in os.environ:
        return
    if not getattr(config, "_is_default", lambda name: False)(OPTION):
        return
    setattr(config, OPTION, True)
    os.environ[VARIABLE] = "1"  # for Inductor's compile workers
    log.info("dmattn_ops: torch._inductor.config.%s = True (see %s)", OPTION, __name__)
    _restart_compile_workers()


def _restart_compile_workers() -> None:
    """Shuts down Inductor's compile-worker pools started before the option was on (module
    docstring); Inductor starts a new pool at its next compile. Nothing where none runs."""
    try:
        from torch._inductor import async_compile
    except ImportError:  # pragma: no cover - torch without Inductor
        return
    pools = getattr(async_compile, "_pool_set", None)
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if pools and shutdown is not None:
        log.info("dmattn_ops: restarting Inductor's compile workers with %s=1", VARIABLE)
        shutdown()
