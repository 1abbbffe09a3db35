"""transformers integration: attn_implementation="dmattn" on a tiny random Llama (no downloads).
Skipped when transformers is not installed."""

import copy
import traceback

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
    ours, sdpa = _same_weights(cfg, "sdpa")
    assert ours.config._attn_implementation == "dmattn"
    return ours.eval(), sdpa.eval()


def _same_weights(cfg, other: str):
    """(ours, theirs): the model of `cfg` on attn_implementation "dmattn" and on `other`, with
    the same (seeded) weights."""
    torch.manual_seed(0)
    # Separate configs: from_config records the implementation in the config it is given.
    ours, theirs = (
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        for impl in ("dmattn", other)
    )
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


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
    ours, eager = _same_weights(cfg, "eager")
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


# Doge natively (dmattn_ops.hf.enable): the per-key bias dt_states and each query's top
# keep_window_size keys as a row-limit mask, against transformers' own eager Doge.
#
# Two things of the eager model are pinned so that equality is exact rather than approximate:
# its softmax runs in float32 whatever the model's dtype (here float64, so the comparison is at
# float64 precision, it runs in float64), and torch.topk picks among tied dt_states as it
# pleases on CPU (ties come from repeated tokens, whose values are equal in the first layer):
# the generation tests give the eager model the tie rule dmattn documents (the lower key index
# first); the forward and gradient tests use sequences without repeated tokens.


def _doge_pair(keep=8, layers=2, dtype=torch.float64):
    cfg = transformers.DogeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, keep_window_size=keep,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.DogeForCausalLM(cfg).to(dtype)
    eager.set_attn_implementation("eager")
    with torch.no_grad():  # A = 0 at initialisation: every dt_state 1.0, all tied
        for m in eager.modules():
            if hasattr(m, "A"):
                m.A.copy_(torch.randn_like(m.A))
    native = dmattn_ops.hf.enable(copy.deepcopy(eager))
    return eager, native


@pytest.fixture
def eager_softmax_in_its_dtype(monkeypatch):
    softmax = torch.nn.functional.softmax

    def in_dtype(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", in_dtype)


@pytest.fixture
def stable_topk(monkeypatch):
    def topk(x, k, dim=-1, largest=True, sorted=True):
        idx = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((x.gather(dim, idx), idx))

    def install():
        monkeypatch.setattr(torch, "topk", topk)

    return install


def _distinct_tokens(b, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(128, generator=g)[:length] for _ in range(b)])


# Separate functions rather than parameters: README command 2 samples parametrized cases, and
# each of these runs there.
def test_doge_native_matches_eager_logits_and_gradients(eager_softmax_in_its_dtype):
    _check_doge_logits_and_gradients(padded=False)


def test_doge_native_matches_eager_with_left_padding(eager_softmax_in_its_dtype):
    _check_doge_logits_and_gradients(padded=True)


def _check_doge_logits_and_gradients(padded):
    eager, native = _doge_pair()
    ids = _distinct_tokens(2, 40, 1)
    pad = None
    if padded:
        pad = torch.ones(2, 40, dtype=torch.long)
        pad[1, :6] = 0
    a = eager(ids, attention_mask=pad).logits
    b = native(ids, attention_mask=pad).logits
    rows = slice(None) if pad is None else pad.bool()
    assert torch.isfinite(b[rows]).all()
    torch.testing.assert_close(b[rows], a[rows], rtol=0, atol=1e-10)
    grad = torch.randn_like(a)
    if pad is not None:
        grad[~pad.bool()] = 0  # padded rows: eager's are a softmax over nothing
    (a * grad).sum().backward()
    (b * grad).sum().backward()
    named = dict(native.named_parameters())
    checked = 0
    for name, p in eager.named_parameters():
        q = named[name]
        scale = max(1.0, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-9 * scale, msg=name)
        checked += name.endswith(".A") or "dt_proj" in name
    assert checked == 4  # A and dt_proj of both layers


def test_doge_native_compiles_fullgraph():
    """The native Doge forward (causal_topk_mask's sort, wavelet matrix and searchsorted, the
    per-key bias, the row-limit call) traces whole: torch.compile(fullgraph=True) gives the
    eager native model's logits and gradients."""
    _, native = _doge_pair()
    ids = _distinct_tokens(2, 40, 2)
    torch._dynamo.reset()
    compiled = torch.compile(native, fullgraph=True, backend="aot_eager")
    runs = []
    for run in (native, compiled):
        native.zero_grad()
        logits = run(ids).logits
        logits.square().mean().backward()
        runs.append([logits.detach()] + [p.grad.clone() for p in native.parameters()])
    assert torch.isfinite(runs[1][0]).all()
    for want, got in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_doge_native_never_builds_the_dense_dynamic_mask(monkeypatch):
    _, native = _doge_pair()
    from transformers.models.doge import modeling_doge

    def refuse(*args, **kwargs):
        raise AssertionError("prepare_dynamic_mask called")

    monkeypatch.setattr(modeling_doge.DogeAttention, "prepare_dynamic_mask", refuse)
    seen = []
    attention = dmattn_ops.attention

    def spy(q, k, v, mask=None, bias=None, **kw):
        seen.append((mask.dtype, tuple(mask.shape), tuple(bias.shape)))
        return attention(q, k, v, mask, bias, **kw)

    monkeypatch.setattr(dmattn_ops, "attention", spy)
    pad = torch.ones(2, 30, dtype=torch.long)
    pad[0, :4] = 0
    native(_distinct_tokens(2, 30, 2), attention_mask=pad)
    assert seen == [(torch.int32, (2, 2, 1, 30), (2, 2, 1, 30))] * 2


def test_doge_native_generates_as_eager_with_a_dynamic_cache(
    stable_topk, eager_softmax_in_its_dtype
):
    _check_doge_generation("dynamic", stable_topk)


def test_doge_native_generates_as_eager_with_a_static_cache(
    stable_topk, eager_softmax_in_its_dtype
):
    _check_doge_generation("static", stable_topk)


def _check_doge_generation(cache, stable_topk):
    # float64 takes the PyTorch path on CPU (the Triton kernels' row limits: test_row_limits.py;
    # on a GPU this float64 model still checks the whole generation loop).
    eager, native = _doge_pair(keep=4)
    eager.eval(), native.eval()
    ids = _distinct_tokens(2, 8, 3)
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[0, :2] = 0
    kw = dict(attention_mask=pad, max_new_tokens=9, do_sample=False, cache_implementation=cache)
    with torch.no_grad():
        got = native.generate(ids, **kw)
        stable_topk()
        want = eager.generate(ids, **kw)
    assert got.shape[1] == 8 + 9  # the cache outgrows keep_window_size: the selection is at work
    assert torch.equal(got, want)


def _host_reads(monkeypatch, generate) -> list[list[str]]:
    """Each read of a tensor's value on the host (Tensor.tolist, item, __bool__; on a GPU a
    sync that stalls the host's queue) that dmattn_ops makes during generate(), after one call
    of it to warm up: the names of the dmattn_ops functions on the stack, outermost first."""
    reads = []

    def spy(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args):
            frames = traceback.extract_stack()[:-1]
            ours = [f.name for f in frames if "dmattn_ops" in f.filename]
            if ours:
                reads.append(ours)
            return original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, read)

    with torch.no_grad():
        generate()
        for name in ("tolist", "item", "__bool__"):
            spy(name)
        generate()
    return reads


def test_doge_native_decoding_reads_no_tensor_on_the_host(monkeypatch):
    """A static-cache generate of the native Doge layer reads no tensor value in dmattn_ops:
    its seqused_k counts the cache's used slots, in range by construction, so the range check
    that a caller's seqused_k gets (one host sync a layer eagerly) is skipped."""
    _, native = _doge_pair(keep=4)
    native.eval()
    ids = _distinct_tokens(2, 8, 3)
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert _host_reads(monkeypatch, lambda: native.generate(ids, **kw)) == []


def test_gpt_oss_decoding_reads_no_tensor_in_its_attention(monkeypatch):
    """GPT-OSS through attn_implementation="dmattn": its sinks are the model's parameter,
    whose finiteness is read once (the warm-up call here) until a write changes it, not once a
    layer a token; what reads remain are the mask builder's (whether the padding mask pads
    anything), once a step, not a layer."""
    ours, _ = _sliding_models("gpt_oss")
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    reads = _host_reads(monkeypatch, lambda: _greedy(ours, ids, cache_implementation="static"))
    assert all(names[0] == "dmattn_mask" for names in reads), reads


def test_doge_enable_refuses_what_it_does_not_compute():
    cfg = transformers.DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window"):
        dmattn_ops.hf.enable(transformers.DogeForCausalLM(cfg))
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="no DogeAttention"):
        dmattn_ops.hf.enable(transformers.LlamaForCausalLM(llama))
