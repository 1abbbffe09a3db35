"""Doge models (transformers' ``DogeForCausalLM``) natively on dmattn against transformers' own
attention implementations: ``python -m bench.doge [--lengths 4096,8192,16384,32768]
[--impls eager,sdpa,flex_attention,dmattn] [--new-tokens 16]``.

For each length and implementation, one model (bf16, B1, 4 layers, hidden 1024, 8 query heads,
4 KV heads of 128, keep_window_size 2048) runs a training step (forward with labels and
backward) and a greedy generation of ``--new-tokens`` tokens after a prompt of that length; the
table gives the median ms of three steps after a warm-up, the generation's ms (after a warm-up
generation from the same prompt), and each one's peak memory. "dmattn" is
``dmattn_ops.hf.enable(model)`` (per-key bias and row-limit mask, no (B, H, L, L) tensor); the
others build Doge's dense dynamic mask (``prepare_dynamic_mask``) and
hand it to their attention as a 4-D bias. A run that does not fit is reported as OOM. Every
implementation is eager PyTorch here (no torch.compile): the same host work around each.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.tables import markdown

LAYERS, HIDDEN, HEADS, KV_HEADS, KEEP = 4, 1024, 8, 4, 2048


def _model(impl: str, device):
    import transformers

    import dmattn_ops.hf

    cfg = transformers.DogeConfig(
        vocab_size=32768, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        keep_window_size=KEEP, max_position_embeddings=65536 + 64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DogeForCausalLM(cfg).to(device, torch.bfloat16)
    with torch.no_grad():  # A = 0 at initialisation makes every dt_state 1.0 (all tied)
        for m in model.modules():
            if hasattr(m, "A"):
                m.A.copy_(torch.randn_like(m.A))
    if impl == "dmattn":
        dmattn_ops.hf.enable(model)
    else:
        model.set_attn_implementation(impl)
    return model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _train_ms(model, ids, device) -> float:
    def step():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    _sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[1]


def _generate_ms(model, ids, new_tokens: int, device) -> float:
    with torch.no_grad():
        # Warm-up at the same prompt length: kernels compile for its shapes once.
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        _sync(device)
    return 1e3 * (time.perf_counter() - t0)


def run(lengths, impls, new_tokens: int, device, whats=("train", "generate")) -> list[list]:
    rows = []
    for length in lengths:
        ids = torch.randint(0, 32768, (1, length), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        for impl in impls:
            row = [length, impl]
            for what in ("train", "generate"):
                if what not in whats:
                    row += ["-", None]
                    continue
                model = None
                _reset(device)
                try:
                    model = _model(impl, device)
                    if what == "train":
                        model.train()
                        ms = _train_ms(model, ids, device)
                    else:
                        model.eval()
                        ms = _generate_ms(model, ids, new_tokens, device)
                    row += [ms, _peak(device)]
                except torch.OutOfMemoryError:
                    row += ["OOM", None]
                except Exception as e:  # an implementation that cannot run this call
                    row += [f"error: {type(e).__name__}", None]
                    print(f"  {impl} L{length} {what}: {type(e).__name__}: {e}"[:300], flush=True)
                del model
            rows.append(row)
            print("  " + " | ".join(str(x) for x in row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.doge", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--impls", default="eager,sdpa,flex_attention,dmattn")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--what", default="train,generate", help="train, generate or both")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(lengths, args.impls.split(","), args.new_tokens, device, args.what.split(","))
    print(markdown(
        ["L", "attention", "train step ms", "peak GiB", f"generate {args.new_tokens} ms",
         "peak GiB"],
        rows, ("", "", ".1f", ".2f", ".1f", ".2f"),
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
