"""Every kernel configuration the launcher can pick fits the shared memory of the GPUs the README
names: each is compiled for sm_90 (H100/H200, 232,448 bytes per block) and sm_80 (A100,
166,912) on this machine, without a GPU, and Triton's own count of its shared memory is checked
against the limit. The configurations come from configs.config over its whole domain (kernel,
head-dim bucket, mask and bias kinds, dtype, decode-sized query tiles), so a new table entry
cannot escape the test.

Compiling takes seconds per kernel, so two checks share the work:

* every configuration over the whole domain is checked against the limits through the model
  configs.shared_bytes (pure arithmetic);
* the model is checked against Triton: for each kernel, head-dim bucket and dtype, the config
  with the heaviest operands (a per-entry mask and a float32 per-entry bias, where shared memory
  peaks) is compiled for both targets, and Triton's count must not exceed the model's. Only
  configs the model puts at COMPILED_FROM (60%) of the limit or more are compiled: a lighter
  one could pass the limit only if Triton used 1.7 times what the model counts, and compiling
  the rest cost a CI machine without a Triton cache minutes.
  Every kernel has configs above that line on both targets (checked).

The kernels are compiled in a subprocess without TRITON_INTERPRET (tests/conftest.py turns the
interpreter on for this process, and interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dmattn_ops.core import configs
from dmattn_ops.core.device import head_block
from dmattn_ops.kernels.attention_bwd_dkdv import attention_bwd_dkdv_kernel
from dmattn_ops.kernels.attention_bwd_dq import attention_bwd_dq_kernel
from dmattn_ops.kernels.attention_decode import attention_decode_kernel
from dmattn_ops.kernels.attention_fwd import attention_fwd_kernel

# The compile of every config for two GPUs (12 minutes cold on two cores): the full run only.
pytestmark = pytest.mark.sweep

TARGETS = {"sm90": (90, configs.SM90_SHARED), "sm80": (80, configs.SM80_SHARED)}
KERNELS = {
    "fwd": attention_fwd_kernel,
    "dkdv": attention_bwd_dkdv_kernel,
    "dq": attention_bwd_dq_kernel,
    "decode": attention_decode_kernel,
}
WIDTHS = (64, 128, 256)  # head-dim buckets of the table (72..128 share 128's block)
OPERANDS = [
    configs.Operands(mask, bias, itemsize, bias_itemsize)
    for mask, bias in (("none", "none"), ("none", "key"), ("none", "entry"), ("key", "key"),
                       ("entry", "entry"), ("key", "entry"), ("listed", "key"), ("listed", "none"),
                       ("packed", "key"), ("packed", "none"))
    for itemsize, bias_itemsize in ((2, 2), (2, 4), (4, 4))
]  # fmt: skip
QUERY_LENGTHS = (None, 1, 16, 2048)  # full tiles, decode-sized ones, short packed key lists
_DTYPES = {2: "fp16", 4: "fp32"}


PER_KEY, PER_ENTRY = 1, 2  # kernels/common.py; the launchers pass these as HAS_MASK/HAS_BIAS


def _flags(kind, jit, args, ops) -> dict:
    """The constexpr flags the launcher passes with these arguments (dmattn_ops/dispatch/launch.py)."""
    bias_kind = {"none": 0, "key": PER_KEY, "entry": PER_ENTRY}[ops.bias]
    flags = dict(
        HAS_MASK=PER_ENTRY if args.get("MASK") is not None else 0,  # only tables pass a mask
        HAS_BIAS=(PER_ENTRY if kind == "decode" else bias_kind) if args.get("BIAS") is not None
        else 0,
        HAS_SEQUSED=args.get("SEQUSED") is not None,
        HAS_SOFTCAP=args["softcap"] > 0,
        # Packed keys in the forward and dq kernels; the dk/dv kernels read through the lists.
        COMPACT=(2 if ops.mask == "packed" and kind in ("fwd", "dq") else 1)
        if args.get("KEYS") is not None
        else 0,
        # Packed keys with a KV group's four query heads per program (plan._pack_heads: long
        # calls, whose tiles these are); one head per program loads the same tiles.
        PACK_G=4 if ops.mask == "packed" and kind in ("fwd", "dq") else 1,
        VARLEN=args.get("CU_Q") is not None,
        HAS_SINKS=args.get("SINKS") is not None,
        HAS_GRAD_LSE=args.get("GRAD_LSE") is not None,
        DBIAS_COLS=args.get("DBIAS_COL") is not None,
        DBIAS_DIRECT=args.get("DBIAS") is not None,
        PARTIAL=args.get("PART_DK") is not None,
        # The DMA launch: a bias per KV group summed in the kernel, unlisted keys zeroed (the
        # launcher zeroes them only in batched calls; compiled here with the varlen code).
        GROUP_COLS=args.get("PART_DB") is not None and args.get("DBIAS_COL") is not None,
        ZERO_UNLISTED=args.get("KEYS") is not None,
    )  # fmt: skip
    return {name: value for name, value in flags.items() if name in jit.arg_names}


def _arguments(kind, jit, cfg, width, ops, float_type="fp32"):
    """Launch arguments of one kernel as the launcher passes them, for one config."""
    block = head_block(width)
    pointer = f"*{_DTYPES[ops.itemsize]}"
    compact = ops.mask in ("key", "listed", "packed") and kind != "decode"
    tables = ops.mask == "entry"
    args, sig = {}, {}
    for name in jit.arg_names:
        if name in ("Q", "K", "V", "DO", "OUT", "DQ", "DK", "DV", "DBIAS"):
            sig[name] = pointer
        elif name == "BIAS":
            sig[name] = None if ops.bias == "none" else f"*{_DTYPES[ops.bias_itemsize]}"
        elif name == "MASK":
            sig[name] = "*i1" if tables else None
        elif name in ("LSE", "LSE_REM", "GRAD_LSE", "STATS", "ACC", "M", "L", "DBIAS_COL"):
            sig[name] = "*fp32"
        elif name in ("PART_DK", "PART_DV", "PART_DB"):
            # Key lists take the split (float32 parts) where the grid is small: compile that
            # store path with them, the direct one with the other operand kinds.
            sig[name] = "*fp32" if compact else None
        elif name in ("KV_NUM", "KV_IDX", "KV_INT", "Q_NUM", "Q_IDX", "Q_LO", "Q_HI"):
            sig[name] = "*i32" if tables else None
        elif name in ("KEYS", "KEY_END", "KEY_COUNT"):
            sig[name] = "*i32" if (compact or (kind == "decode" and ops.mask != "none")) else None
        elif name == "KEY_START":
            sig[name] = None  # window launches: tests/test_window.py compiles them
        elif name in ("SEQUSED", "CU_Q", "CU_K"):
            sig[name] = "*i32"
        elif name == "SINKS":
            # The forward kernel with sinks where a bias is given, without them otherwise.
            sig[name] = None if ops.bias == "none" else "*fp32"
        elif name in ("scale", "softcap"):
            sig[name] = float_type
        elif jit.params[jit.arg_names.index(name)].is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    for name, ty in sig.items():
        if ty is None:
            args[name] = None
        elif ty.startswith("*"):
            args[name] = torch.empty(1)  # only its presence matters to the flags
        else:
            args[name] = 1
    # Operand strides: per-entry operands have a query stride, per-key ones 0.
    for prefix, kind_ in (("stride_m", ops.mask), ("stride_b", ops.bias)):
        for name in (prefix + "m",):
            if name in args:
                args[name] = 7 if kind_ == "entry" else 0
    args.update(softcap=1.0, scale=0.1)
    meta = dict(
        IS_CAUSAL=True, HAS_WINDOW=False, BLOCK_M=cfg.block_m or 64, BLOCK_N=cfg.block_n, BLOCK_D=block,
        BLOCK_DV=block, DOT_PRECISION="ieee" if ops.itemsize == 4 else "tf32",
        D=width, Dv=width,  # constexprs of the forward and backward kernels
    )  # fmt: skip
    args.update({k: v for k, v in meta.items() if k in jit.arg_names})
    return args, sig


def shared_memory(kind, cfg, width, ops, cc, float_type="fp32") -> int:
    jit = KERNELS[kind]
    args, sig = _arguments(kind, jit, cfg, width, ops, float_type)
    args.update(_flags(kind, jit, args, ops))
    signature, constexprs = {}, {}
    for i, name in enumerate(jit.arg_names):
        if jit.params[i].is_constexpr or args[name] is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = args[name]
        else:
            signature[name] = sig[name]
    src = ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options).metadata.shared


def _domain():
    """(kind, width, operands, lq) over the whole domain of configs.config."""
    for kind, width, ops, lq in itertools.product(KERNELS, WIDTHS, OPERANDS, QUERY_LENGTHS):
        if kind == "decode" and (ops.mask == "entry" or lq is None):
            continue  # decode runs only for a few queries and one key list per KV group
        yield kind, width, ops, lq


def _modelled(kind, cfg, width, ops) -> int:
    if kind == "decode":  # decode tiles hold up to 64 query rows (plan.DECODE_MAX_ROWS)
        cfg = configs.Config(64, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return configs.shared_bytes(kind, cfg, width, width, ops)


@pytest.mark.parametrize("target", TARGETS)
def test_every_config_fits_by_the_model(target):
    _, limit = TARGETS[target]
    for kind, width, ops, lq in _domain():
        cfg = configs.config(kind, width, width, ops, lq=lq, limit=limit)
        used = _modelled(kind, cfg, width, ops)
        assert used <= limit, f"{kind} D{width} {ops} lq={lq}: {cfg} models {used} > {limit}"


HEAVIEST = [configs.Operands("entry", "entry", 2, 4), configs.Operands("entry", "entry", 4, 4)]
# Tables of their own: dense tiles (no mask, a per-key bias) and key lists, 16-bit.
OWN_TABLES = [
    configs.Operands("none", "key", 2, 2),
    configs.Operands("key", "key", 2, 2),
    configs.Operands("listed", "key", 2, 2),
    configs.Operands("packed", "key", 2, 2),
]
COMPILED_FROM = 0.6


def _compiled_cases(target):
    _, limit = TARGETS[target]
    seen = set()
    for kind, width, ops, lq in _domain():
        if ops not in HEAVIEST + OWN_TABLES and not (
            kind == "decode" and ops == configs.Operands("key", "entry", 2, 4)
        ):
            continue
        cfg = configs.config(kind, width, width, ops, lq=lq, limit=limit)
        if _modelled(kind, cfg, width, ops) < COMPILED_FROM * limit:
            continue
        if (kind, cfg, width, ops) not in seen:
            seen.add((kind, cfg, width, ops))
            yield kind, cfg, width, ops


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_has_compiled_configs(target):
    assert {kind for kind, *_ in _compiled_cases(target)} == set(KERNELS)


def _cases_of(target, kernel):
    return [case for case in _compiled_cases(target) if case[0] == kernel]


def _compile_all(target, kernel) -> list:
    cc, _ = TARGETS[target]
    return [
        (kind, vars(cfg), width, vars(ops), shared_memory(kind, cfg, width, ops, cc))
        for kind, cfg, width, ops in _cases_of(target, kernel)
    ]


# One test per target and kernel, so that pytest-xdist spreads the compiles over its workers.
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", TARGETS)
def test_compiled_shared_memory_within_model_and_limit(target, kernel):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, __file__, target, kernel], capture_output=True, text=True, env=env,
        cwd=os.path.dirname(__file__), timeout=1200,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) == len(_cases_of(target, kernel))
    _, limit = TARGETS[target]
    for kind, cfg, width, ops, used in results:
        cfg, ops = configs.Config(**cfg), configs.Operands(**ops)
        what = f"{target} {kind} {cfg} D{width} {ops}"
        assert used <= limit, f"{what}: {used} bytes of shared memory > {limit}"
        modelled = _modelled(kind, cfg, width, ops)
        assert used <= modelled, f"{what}: the model ({modelled}) is below Triton's count ({used})"


def test_the_issue_13_crash_configs_fit():
    """B2 L513 H8 Hkv1 D96 with a (2, 1, 513, 513) bias and B1 L1024 H4 D128 with a 4-D bias:
    262,144 and 294,912 bytes with the old 128x128, 3-stage forward on an H100."""
    for width in (96, 128):
        ops = configs.Operands("none", "entry", 2, 2)
        cfg = configs.config("fwd", width, width, ops, limit=configs.SM90_SHARED)
        assert configs.shared_bytes("fwd", cfg, width, width, ops) <= configs.SM90_SHARED
        assert cfg.num_stages < 3


def _compile_fp64_floats() -> list:
    """Every attention kernel, heaviest operands, compiled with scale and softcap typed fp64."""
    ops = configs.Operands("key", "entry", 2, 2)
    done = []
    for kind in KERNELS:
        cfg = configs.config(kind, 64, 64, ops, limit=configs.SM90_SHARED)
        shared_memory(kind, cfg, 64, ops, 90, float_type="fp64")
        done.append(kind)
    return done


def test_kernels_compile_with_fp64_float_arguments():
    """A compiled graph's launcher (Inductor) types Python float arguments fp64 where Triton's
    own launcher passes fp32; the kernels take them to fp32 first (common.as_fp32), or the
    scores and accumulators turn float64 and tl.dot refuses them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, __file__, "fp64"], capture_output=True, text=True, env=env,
        cwd=os.path.dirname(__file__), timeout=1200,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == list(KERNELS)


if __name__ == "__main__":
    what = sys.argv[1]
    print(json.dumps(_compile_fp64_floats() if what == "fp64" else _compile_all(*sys.argv[1:])))


COMPILE_KEY_LISTS = """
from helpers import compile_for_gpu

from dmattn_ops.kernels.key_lists import key_lists_kernel, varlen_key_lists_kernel

POINTERS = dict(MASK="*u8", SEQUSED="*i32", CU_Q="*i32", CU_K="*i32", PREFIX="*i32",
                KEYS="*i32", KEY_START="*i32", KEY_END="*i32", KEY_COUNT="*i32", K="*bf16",
                V="*bf16", BIAS="*bf16", K_OUT="*bf16", V_OUT="*bf16", BIAS_OUT="*bf16")


def compile(k, values):
    compile_for_gpu(k, values, POINTERS, 90)


for window in (False, True):
    absent = {} if window else dict(KEY_START=None)
    compile(varlen_key_lists_kernel, dict(IS_CAUSAL=not window, HAS_WINDOW=window, BLOCK_M=64,
                                          CHUNK=1024, **absent))
    for pack, bias in ((False, False), (True, False), (True, True)):
        values = dict(HAS_SEQUSED=not window, IS_CAUSAL=not window, HAS_WINDOW=window, PACK=pack,
                      HAS_BIAS=bias, BLOCK_M=64, CHUNK=64, SCAN=4096, BLOCK_T=512, BLOCK_D=128,
                      BLOCK_DV=128, **absent)
        if window:
            values["SEQUSED"] = None
        if not pack:
            values.update(K=None, V=None, K_OUT=None, V_OUT=None)
        if not bias:
            values.update(BIAS=None, BIAS_OUT=None)
        compile(key_lists_kernel, values)
print("ok")
"""


def test_key_lists_kernel_compiles_for_sm90():
    """The key-list kernels (batched, with and without packing, and varlen) compile for sm_90
    without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE_KEY_LISTS], capture_output=True,
                         text=True, env=env, cwd=os.path.dirname(__file__), timeout=600)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
