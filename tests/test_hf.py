"""transformers integration: attn_implementation="dmattn" on a tiny random Llama (no downloads).
Skipped when transformers is not installed."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dmattn_ops.hf  # noqa: E402


@pytest.fixture(scope="module")
def models():
    dmattn_ops.hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    # Separate configs: from_config records the implementation in the config it is given.
    ours = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="dmattn"
    )
    sdpa = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="sdpa"
    )
    sdpa.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "dmattn"
    return ours.eval(), sdpa.eval()


def test_matches_sdpa_with_causal_and_padding(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 21))
    pad = torch.ones(2, 21, dtype=torch.long)
    pad[1, :5] = 0  # left padding
    torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, rtol=0, atol=1e-5)
    a, b = ours(ids, attention_mask=pad).logits, sdpa(ids, attention_mask=pad).logits
    torch.testing.assert_close(a[pad.bool()], b[pad.bool()], rtol=0, atol=1e-5)


def test_dynamic_mask_and_bias_pass_through(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 21))
    pad = torch.ones(2, 21, dtype=torch.long)
    pad[1, :5] = 0
    # The padding expressed as a DMA mask per (batch, key) gives the padded model's result
    # (with the same positions: transformers derives them from a padding mask otherwise).
    pos = torch.arange(21).expand(2, -1)
    bias = torch.zeros(2, 2, 1, 21, requires_grad=True)
    out = ours(ids, position_ids=pos, dma_mask=pad.bool()[:, None, None, :], dma_bias=bias).logits
    ref = sdpa(ids, position_ids=pos, attention_mask=pad).logits
    torch.testing.assert_close(out[pad.bool()], ref[pad.bool()], rtol=0, atol=1e-5)
    out.square().sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    assert (bias.grad[1, :, :, :5] == 0).all()  # masked keys get no bias gradient
    # A bias that changes the scores changes the output.
    shifted = ours(ids, dma_bias=torch.randn(1, 2, 1, 21) * 3).logits
    assert (shifted - ours(ids).logits).abs().max() > 1e-3


def test_trains_a_few_steps(models):
    ours, _ = models
    model = ours.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (4, 16))
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    model.eval()


def _call(**kwargs):
    q = torch.randn(1, 2, 5, 8)
    k = v = torch.randn(1, 1, 5, 8)
    return dmattn_ops.hf.dmattn_attention_forward(torch.nn.Module(), q, k, v, None, **kwargs)


@pytest.mark.parametrize(
    "name, value",
    [("cu_seq_lens_q", torch.tensor([0, 5])),
     ("head_mask", torch.ones(2)), ("made_up_argument", 3)],
)  # fmt: skip
def test_kwargs_that_change_the_math_are_refused(name, value):
    with pytest.raises(ValueError, match=f"keyword argument '{name}'"):
        _call(**{name: value})


def test_bookkeeping_and_none_kwargs_are_accepted():
    out, _ = _call(position_ids=torch.arange(5)[None], use_cache=False, sliding_window=4096,
                   s_aux=None, head_mask=None, cache_position=torch.arange(5))  # fmt: skip
    assert out.shape == (1, 5, 2, 8) and torch.isfinite(out).all()


def test_gpt_oss_sinks_are_applied():
    q = torch.randn(1, 2, 5, 8)
    k = v = torch.randn(1, 1, 5, 8)
    s_aux = torch.tensor([0.3, -0.7])
    out, _ = dmattn_ops.hf.dmattn_attention_forward(
        torch.nn.Module(), q, k, v, None, scaling=0.5, is_causal=True, s_aux=s_aux
    )
    want = dmattn_ops.reference.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.5, is_causal=True,
        sinks=s_aux,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


def _sliding_models(name):
    """A tiny random model of a sliding-window family, as ours and eager (same weights)."""
    dmattn_ops.hf.register()
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  head_dim=16)  # fmt: skip
    if name == "mistral":
        cfg = transformers.MistralConfig(sliding_window=5, **common)
    elif name == "gemma2":
        cfg = transformers.Gemma2Config(sliding_window=5, attn_logit_softcapping=20.0,
                                        query_pre_attn_scalar=16, **common)  # fmt: skip
    else:
        cfg = transformers.GptOssConfig(sliding_window=5, num_local_experts=4,
                                        num_experts_per_tok=2, **common)  # fmt: skip
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="dmattn"
    )
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="eager"
    )
    eager.load_state_dict(ours.state_dict())
    if name == "gpt_oss":  # random sinks of a visible size, so that dropping them would show
        with torch.no_grad():
            for m in ours.modules():
                if hasattr(m, "sinks"):
                    m.sinks.normal_(0.0, 1.0)
        eager.load_state_dict(ours.state_dict())
    return ours.float().eval(), eager.float().eval()


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_window_models_match_eager_without_a_mask(name, monkeypatch):
    ours, eager = _sliding_models(name)
    seen = []
    forward = dmattn_ops.hf.dmattn_attention_forward

    def spy(module, q, k, v, attention_mask, *args, **kwargs):
        seen.append((attention_mask, kwargs.get("sliding_window")))
        return forward(module, q, k, v, attention_mask, *args, **kwargs)

    monkeypatch.setattr(transformers.AttentionInterface, "_global_mapping",
                        {**transformers.AttentionInterface._global_mapping, "dmattn": spy})  # fmt: skip
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    logits = ours(ids).logits
    want = eager(ids).logits
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    windowed = [s for m, s in seen if s is not None]
    assert windowed, "no layer passed its sliding window"
    assert all(m is None for m, _ in seen), "a (B, 1, L, L) mask was built"
    # Gradients of every parameter.
    logits.square().mean().backward()
    want.square().mean().backward()
    for (n, a), (_, b) in zip(ours.named_parameters(), eager.named_parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5, msg=n)
    # Greedy generation, with the cache: the same tokens.
    with torch.no_grad():
        got = ours.generate(ids[:1, :6], max_new_tokens=8, do_sample=False)
        exp = eager.generate(ids[:1, :6], max_new_tokens=8, do_sample=False)
    assert torch.equal(got, exp)


def _greedy(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=12, **kw)


def test_static_cache_generation_matches_eager(models):
    # The prefill of a static cache reaches the attention function with Lq 12, Lk 31 and no
    # mask: transformers means SDPA's top-left is_causal (the cache's later slots unused).
    ours, _ = models
    eager = copy.deepcopy(ours)
    eager.config._attn_implementation = "eager"
    eager.set_attn_implementation("eager")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    for kw in (dict(cache_implementation="static"), dict()):
        got, want = _greedy(ours, ids, **kw), _greedy(eager, ids, **kw)
        assert torch.equal(got, want), kw


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_window_models_generate_with_a_static_cache(name):
    ours, eager = _sliding_models(name)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    got = _greedy(ours, ids, cache_implementation="static")
    want = _greedy(eager, ids, cache_implementation="static")
    assert torch.equal(got, want)


def test_a_missing_mask_with_fewer_queries_than_keys_is_top_left():
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 2, 9, 8)
    used = k[:, :, :5].clone()
    k[:, :, 5:] = float("nan")  # unused static-cache slots
    out, _ = dmattn_ops.hf.dmattn_attention_forward(torch.nn.Module(), q, k, k, None)
    want = dmattn_ops.reference.attention(  # top-left: query i sees keys j <= i
        q.transpose(1, 2), used.transpose(1, 2), used.transpose(1, 2), is_causal=True
    )
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
