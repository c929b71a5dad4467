"""MoE-FFD, MoMHA and the routed-linear op against per-token, per-expert loops;
gradient checks; E = k = 1 equals the dense layers; no-op rows cost nothing."""
import math

import pytest
import torch
import torch.nn.functional as F

from sut_fairseq.modules.moe_ffd import MoEFeedForward
from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention
from sut_fairseq.modules.router import Router
from sut_fairseq.ops import make_routing, routed_linear


def _routing(N, k, E, active, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    gates = torch.rand(N, k, generator=g, dtype=torch.float64)
    gates = gates / gates.sum(1, keepdim=True)
    idx = torch.where(active[:, None], idx, E)
    gates = gates * active[:, None]
    return make_routing(idx, gates, E)


@pytest.mark.parametrize("k,E", [(1, 3), (2, 4), (4, 4)])
def test_routed_linear_layouts_match_loops(k, E):
    N, din, dout = 7, 5, 3
    active = torch.tensor([True, False, True, True, False, True, True])
    r = _routing(N, k, E, active)
    W = torch.randn(E, din, dout, dtype=torch.float64)
    b = torch.randn(E, dout, dtype=torch.float64)
    x = torch.randn(N, din, dtype=torch.float64)
    slot_out = torch.zeros(N * k, dout, dtype=torch.float64)
    token_out = torch.zeros(N, dout, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = r.expert_idxs[n, j].item()
            if e < E:
                slot_out[n * k + j] = x[n] @ W[e] + b[e]
                token_out[n] += r.gates[n, j] * slot_out[n * k + j]
    # token rows in -> slot rows out
    torch.testing.assert_close(routed_linear(x, W, b, r, fan_out=k), slot_out)
    # token rows in -> gated sum out
    torch.testing.assert_close(routed_linear(x, W, b, r, fan_out=k, gates=r.gates), token_out)
    # token rows in -> sorted rows out; sorted rows in -> gated sum (the FFD's two steps)
    grouped = routed_linear(x, W, b, r, fan_out=k, grouped_out=True)
    n_active = int(active.sum()) * k
    torch.testing.assert_close(grouped[:n_active], slot_out[r.sorted_scattered_idxs[:n_active]])
    assert (grouped[n_active:] == 0).all()
    # slot rows in (fan_out = 1) -> gated sum (MoMHA's output projection)
    xs = torch.randn(N * k, din, dtype=torch.float64)
    expect = torch.zeros(N, dout, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = r.expert_idxs[n, j].item()
            if e < E:
                expect[n] += r.gates[n, j] * (xs[n * k + j] @ W[e] + b[e])
    torch.testing.assert_close(routed_linear(xs, W, b, r, fan_out=1, gates=r.gates), expect)


@pytest.mark.parametrize("layout", ["slots", "gated", "grouped", "grouped_in_gated", "slot_rows_gated"])
def test_routed_linear_gradcheck(layout):
    """float64 gradcheck of every input (x, W, b, gates) in each layout MoE-FFD and MoMHA use,
    with ragged loads, an empty expert and halted rows."""
    N, k, E, din, dout = 6, 2, 4, 3, 2
    active = torch.tensor([True, True, False, True, True, True])
    g = torch.Generator().manual_seed(3)
    idx = torch.tensor([[0, 1], [1, 0], [2, 3], [0, 1], [1, 0], [0, 1]])  # expert 2, 3: empty
    idx = torch.where(active[:, None], idx, E)
    gates = torch.rand(N, k, generator=g, dtype=torch.float64) * active[:, None]
    r = make_routing(idx, gates, E)
    W = torch.randn(E, din, dout, dtype=torch.float64, requires_grad=True)
    b = torch.randn(E, dout, dtype=torch.float64, requires_grad=True)
    rows = {"slot_rows_gated": N * k, "grouped_in_gated": N * k}.get(layout, N)
    x = torch.randn(rows, din, dtype=torch.float64, requires_grad=True)
    gates = r.gates.clone().requires_grad_(True)

    def f(x, W, b, gates):
        routing = make_routing(r.expert_idxs, gates, E)
        kw = dict(slots=dict(fan_out=k), gated=dict(fan_out=k, gates=gates),
                  grouped=dict(fan_out=k, grouped_out=True),
                  grouped_in_gated=dict(fan_out=1, grouped_in=True, gates=gates),
                  slot_rows_gated=dict(fan_out=1, gates=gates))[layout]
        return routed_linear(x, W, b, routing, **kw)

    assert torch.autograd.gradcheck(f, (x, W, b, gates))


def test_routed_linear_all_rows_halted_gives_zeros():
    r = _routing(4, 2, 3, torch.zeros(4, dtype=torch.bool))
    W = torch.randn(3, 5, 6, requires_grad=True)
    out = routed_linear(torch.randn(4, 5), W, None, r, fan_out=2, gates=r.gates.float())
    assert out.shape == (4, 6) and (out == 0).all()


def _ffd(E, k, d=6, D=5, seed=0, dtype=torch.float64, activation="gelu"):
    torch.manual_seed(seed)
    m = MoEFeedForward(d, D, E, k, router_hidden_dim=7, activation_fn=activation).to(dtype)
    with torch.no_grad():
        m.up.bias.normal_()
        m.down.bias.normal_()
    return m


def _router_choice(router, x):
    """(N, k) experts and renormalised gates, computed row by row."""
    idxs, gates = [], []
    for row in x:
        if router.num_experts == 1:
            idxs.append([0])
            gates.append([1.0])
            continue
        p = torch.softmax(router.fc2(torch.tanh(router.fc1(row))).double(), -1)
        top = torch.topk(p, router.top_k)
        idxs.append(top.indices.tolist())
        gates.append((top.values / top.values.sum()).tolist())
    return idxs, gates


@pytest.mark.parametrize("E,k", [(4, 2), (3, 1), (3, 3), (1, 1)])
def test_moe_ffd_matches_per_token_per_expert_loop(E, k):
    m = _ffd(E, k)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    active = torch.rand(2, 5) > 0.3
    y = m(x, active)
    flat, act = x.reshape(-1, 6), active.reshape(-1)
    idxs, gates = _router_choice(m.router, flat)
    expect = torch.zeros_like(flat)
    for n in range(flat.size(0)):
        if not act[n]:
            continue
        for e, g in zip(idxs[n], gates[n]):
            expect[n] += g * (m.activation_fn(flat[n] @ m.up.weight[e] + m.up.bias[e]) @ m.down.weight[e] + m.down.bias[e])
    torch.testing.assert_close(y.reshape(-1, 6), expect)


@pytest.mark.parametrize("E,k", [(4, 2), (1, 1)])
def test_moe_ffd_gradcheck(E, k):
    m = _ffd(E, k, activation="tanh")  # smooth activation in float64 (fairseq's gelu runs in fp32)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    active = torch.tensor([True, True, False, True, True])
    params = [m.up.weight, m.up.bias, m.down.weight, m.down.bias]

    # gradcheck over the input and every expert tensor (routing is piecewise constant)
    assert torch.autograd.gradcheck(lambda x, *ps: _with_params(m, params, ps, lambda: m(x, active)),
                                    (x, *[p.detach().clone().requires_grad_() for p in params]))


def _with_params(module, params, values, fn):
    """Evaluate fn() with module parameters temporarily replaced by ``values`` (differentiably)."""
    names = {id(p): n for n, p in module.named_parameters()}
    saved = {}
    for p, v in zip(params, values):
        name = names[id(p)]
        owner = module
        *path, leaf = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        saved[(owner, leaf)] = owner._parameters[leaf]
        owner._parameters[leaf] = v
    try:
        return fn()
    finally:
        for (owner, leaf), p in saved.items():
            owner._parameters[leaf] = p


def test_dense_ffd_equals_transformer_ffn():
    m = _ffd(1, 1, activation="relu")
    fc1, fc2 = torch.nn.Linear(6, 5).double(), torch.nn.Linear(5, 6).double()
    with torch.no_grad():
        fc1.weight.copy_(m.up.weight[0].T); fc1.bias.copy_(m.up.bias[0])
        fc2.weight.copy_(m.down.weight[0].T); fc2.bias.copy_(m.down.bias[0])
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    torch.testing.assert_close(m(x, torch.ones(3, 4, dtype=torch.bool)), fc2(F.relu(fc1(x))))


def _momha(E, k, H=2, D=3, d=6, relative=None, window=2, causal=False, seed=0):
    torch.manual_seed(seed)
    m = MixtureOfMultiHeadAttention(d, d, E, k, H, D, router_hidden_dim=5, relative=relative,
                                    window=window, causal=causal).double()
    with torch.no_grad():
        m.q_proj.bias.normal_(); m.o_proj.bias.normal_(); m.k_proj.bias.normal_(); m.v_proj.bias.normal_()
    return m


def test_momha_beams_over_shared_keys_equal_each_row_with_its_own_keys():
    """Beam search's cross-attention: G = 2 beams of each of 2 sentences (4 query rows of 3
    positions) over the sentences' 2 key rows, one of them padded, give what each query row
    gives over its own copy of its sentence's keys."""
    m = _momha(4, 2)
    torch.manual_seed(5)
    src = torch.randn(2, 5, 6, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -2:] = True
    query = torch.randn(4, 3, 6, dtype=torch.float64)
    active = torch.ones(4, 3, dtype=torch.bool)
    with torch.no_grad():
        k, v = m.project_kv(src)
        shared = m(query, k, v, active, key_padding_mask=pad)
        own = m(query, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), active,
                key_padding_mask=pad.repeat_interleave(2, 0))
    torch.testing.assert_close(shared, own)


def test_momha_rows_at_their_places_in_the_beam_grid_equal_those_rows_alone():
    """``grid_rows``: 3 of the 6 rows of a grid of G = 3 beams over 2 sentences (one padded),
    attending from their places, give what each gives over its own copy of its sentence's
    keys; the rows at other places differ (the places are read)."""
    m = _momha(4, 2)
    torch.manual_seed(7)
    src = torch.randn(2, 5, 6, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, -3:] = True
    query = torch.randn(3, 1, 6, dtype=torch.float64)
    active = torch.ones(3, 1, dtype=torch.bool)
    places = torch.tensor([1, 3, 5])  # beam 1 of sentence 0, beams 0 and 2 of sentence 1
    with torch.no_grad():
        k, v = m.project_kv(src)
        grid = m(query, k, v, active, key_padding_mask=pad, grid_rows=(places, 6))
        sentence = places // 3
        own = m(query, k[sentence], v[sentence], active, key_padding_mask=pad[sentence])
        elsewhere = m(query, k, v, active, key_padding_mask=pad, grid_rows=(torch.tensor([0, 1, 2]), 6))
    torch.testing.assert_close(grid, own)
    assert not torch.allclose(elsewhere[1:], own[1:])


@pytest.mark.parametrize("relative,causal,key_rows", [(None, False, 3), (None, True, 2), ("clipped", False, 2)])
def test_momha_refuses_shared_keys_where_they_do_not_apply(relative, causal, key_rows):
    """Query rows sharing key rows: only a whole number of rows per key row, not causal,
    no relative term (4 query rows, H = 2 heads)."""
    m = _momha(4, 2, relative=relative, causal=causal)
    query, keys = torch.randn(4, 3, 6, dtype=torch.float64), torch.randn(key_rows, 2, 5, 3, dtype=torch.float64)
    message = (f"4 query rows over {key_rows} key rows: shared keys are for non-causal attention "
               "without relative positions")
    with pytest.raises(ValueError) as error:
        m(query, keys, keys, torch.ones(4, 3, dtype=torch.bool))
    assert str(error.value) == message


@pytest.mark.parametrize("E,k,relative,causal", [(4, 2, None, False), (3, 3, "clipped", True),
                                                 (4, 2, "clipped", False),
                                                 (3, 1, "t5", False), (2, 2, "t5", True),
                                                 (1, 1, "clipped", True), (1, 1, None, False)])
def test_momha_matches_per_token_per_expert_loop(E, k, relative, causal):
    m = _momha(E, k, relative=relative, causal=causal)
    B, T, S, H, D = 2, 4, 4, 2, 3
    q_in = torch.randn(B, T, 6, dtype=torch.float64)
    kv_in = torch.randn(B, S, 6, dtype=torch.float64)
    active = torch.tensor([[True, True, False, True], [True, True, True, True]])
    kpm = torch.tensor([[False, False, False, False], [True, False, False, False]])
    K, V = m.project_kv(kv_in)
    if causal:
        kpm[:] = False  # causal attention with padding keys: tests/decoding/test_incremental.py (left pads)
    y = m(q_in, K, V, active, key_padding_mask=kpm)
    idxs, gates = _router_choice(m.router, q_in.reshape(-1, 6))
    expect = torch.zeros(B, T, 6, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            n = b * T + t
            expect[b, t] = m.o_proj.bias
            if not active[b, t]:
                continue
            for e, g in zip(idxs[n], gates[n]):
                q = (q_in[b, t] @ m.q_proj.weight[e] + m.q_proj.bias[e]).view(H, D)
                heads = []
                for h in range(H):
                    logits = []
                    for s in range(S):
                        z = q[h] @ K[b, h, s] / math.sqrt(D)
                        if relative == "clipped":
                            off = max(-2, min(2, s - t))
                            z = z + q[h] @ m.relative.embeddings[off + 2, h] / math.sqrt(D)
                        elif relative == "t5":
                            from sut_fairseq.modules.relative_position import t5_bucket
                            bucket = t5_bucket(torch.tensor(s - t), not causal, 32, 128)
                            z = z + m.relative.bias.weight[bucket, h]
                        if kpm[b, s] or (causal and s > t):
                            z = torch.tensor(float("-inf"), dtype=torch.float64)
                        logits.append(z)
                    p = torch.softmax(torch.stack(logits), 0)
                    heads.append((p[:, None] * V[b, h]).sum(0))
                expect[b, t] += g * (torch.cat(heads) @ m.o_proj.weight[e])
    torch.testing.assert_close(y, expect)


@pytest.mark.parametrize("T", [1, 2])
def test_one_decoding_position_scores_the_offsets_apart_without_copying_the_keys(T, monkeypatch):
    """The clipped path at one query position (incremental decoding) computes q·r apart and
    never joins the relative vectors to the S cached keys (no ``torch.cat``); at two
    positions it joins them. Both equal SDPA with the additive bias."""
    m = _momha(3, 2, relative="clipped", window=1, causal=True)
    with torch.no_grad():
        m.relative.embeddings.normal_()
    B, H, D, q_start = 2, 2, 3, 4
    S = q_start + T
    q = torch.randn(B, H, T * 2, D, dtype=torch.float64)
    key, value = torch.randn(B, H, S, D, dtype=torch.float64), torch.randn(B, H, S, D, dtype=torch.float64)
    hidden = m._hidden_keys(q, T, q_start, S, None)
    joined, cat = [], torch.cat
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(torch, "cat", lambda *a, **kw: joined.append(1) or cat(*a, **kw))
        got = m._attend_clipped(q, key, value, T, q_start, hidden)
    assert len(joined) == (0 if T == 1 else 1)
    want = F.scaled_dot_product_attention(q, key, value, attn_mask=m._attention_bias(q, T, q_start, S, hidden))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal,q_start", [(False, 0), (True, 0), (True, 3)])
def test_clipped_attention_paths_agree(causal, q_start):
    """The CPU path of clipped relative attention (relative vectors appended to the keys,
    plain softmax) equals ``scaled_dot_product_attention`` with the additive bias (the
    path CUDA takes), values and gradients, with padding keys and a window smaller than
    the offsets that occur."""
    m = _momha(3, 2, relative="clipped", window=1, causal=causal)
    with torch.no_grad():
        m.relative.embeddings.normal_()
    B, T, H, D = 2, 3, 2, 3
    S = q_start + T
    q = torch.randn(B, H, T * 2, D, dtype=torch.float64, requires_grad=True)
    key = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    value = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 0] = True
    hidden = m._hidden_keys(q, T, q_start, S, kpm)
    outs, grads = [], []
    for path in ("cpu", "sdpa"):
        if path == "cpu":
            o = m._attend_clipped(q, key, value, T, q_start, hidden)
        else:
            o = F.scaled_dot_product_attention(q, key, value,
                                               attn_mask=m._attention_bias(q, T, q_start, S, hidden))
        w = torch.randn_like(o, generator=torch.Generator().manual_seed(1))
        outs.append(o)
        grads.append(torch.autograd.grad((o * w).sum(), (q, key, value, m.relative.embeddings)))
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("E,k", [(3, 2), (1, 1)])
def test_momha_gradcheck(E, k):
    m = _momha(E, k, relative="clipped", causal=True)
    with torch.no_grad():  # non-zero T5/relative parameters so their gradients are exercised
        m.relative.embeddings.normal_()
    q_in = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    kv_in = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    active = torch.tensor([[True, False, True]])
    params = [m.q_proj.weight, m.q_proj.bias, m.o_proj.weight, m.relative.embeddings]

    def f(q_in, kv_in, *ps):
        def run():
            K, V = m.project_kv(kv_in)
            return m(q_in, K, V, active)
        return _with_params(m, params, ps, run)

    assert torch.autograd.gradcheck(f, (q_in, kv_in, *[p.detach().clone().requires_grad_() for p in params]))


def test_dense_momha_equals_multihead_attention():
    d, H = 6, 2
    m = _momha(1, 1, H=H, D=3, d=d)
    mha = torch.nn.MultiheadAttention(d, H, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([m.q_proj.weight[0].T, m.k_proj.weight, m.v_proj.weight]))
        mha.in_proj_bias.copy_(torch.cat([m.q_proj.bias[0], m.k_proj.bias, m.v_proj.bias]))
        mha.out_proj.weight.copy_(m.o_proj.weight[0].T)
        mha.out_proj.bias.copy_(m.o_proj.bias)
    q, kv = torch.randn(2, 4, d, dtype=torch.float64), torch.randn(2, 5, d, dtype=torch.float64)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, :2] = True
    K, V = m.project_kv(kv)
    ours = m(q, K, V, torch.ones(2, 4, dtype=torch.bool), key_padding_mask=kpm)
    ref, _ = mha(q, kv, kv, key_padding_mask=kpm)
    torch.testing.assert_close(ours, ref)


def test_halted_positions_are_sent_to_no_expert(monkeypatch):
    """Count the rows every expert op receives in a full model forward: only running
    (position, step) pairs, k slots each."""
    from conftest import make_model, randomise_halting
    import sut_fairseq.modules.expert_linear as expert_linear

    rows = []

    def counting(x, weight, bias, routing, fan_out, grouped_in=False, grouped_out=False, gates=None,
                 tag=-1, **activation):
        rows.append((routing.expert_offsets[-1].item(), (routing.expert_idxs < routing.num_experts).sum().item()))
        from sut_fairseq.ops.routed_linear import reference_routed_linear
        return reference_routed_linear(x, weight, bias, routing, fan_out, grouped_in, grouped_out, gates,
                                       tag=tag, **activation)

    monkeypatch.setattr(expert_linear, "routed_linear", counting)
    model = make_model(halting_threshold=0.6, decoder_layers=3, encoder_layers=3)
    randomise_halting(model)
    src = torch.randint(4, 40, (3, 6))
    src[0, :3] = 1
    with torch.no_grad():
        res = model.encoder(src)["halting"][0]
    executed = res.steps.sum().item()
    assert executed < res.real.sum().item() * 3, "some positions must halt early"
    # encoder: self-attn q, self-attn o, ffd up, ffd down per step; k = 2 slots per row
    routed = sum(r for r, _ in rows)
    assert routed == 4 * 2 * executed
    assert all(r == n for r, n in rows)


@pytest.mark.parametrize("shared_bias", [False, True])
def test_one_expert_dense_map_equals_the_routed_one_in_values_and_gradients(shared_bias):
    """``ExpertLinear.dense`` (E = 1: the active rows through one masked GEMM) against the
    routed op on the one-expert routing of the same rows (every active row to expert 0
    with gate 1, the others to the no-op expert): outputs, dx, dW, db."""
    from sut_fairseq.modules.expert_linear import ExpertLinear

    torch.manual_seed(0)
    layer = ExpertLinear(1, 5, 4, shared_bias=shared_bias).double()
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    active = torch.tensor([True, False, True, True, False, True, True])
    dy = torch.randn(7, 4, dtype=torch.float64)
    routing = make_routing(torch.where(active, 0, 1).unsqueeze(1), active.double().unsqueeze(1), 1)
    results = []
    for run in (lambda: layer.dense(x, active), lambda: layer(x, routing, fan_out=1, gates=routing.gates)):
        layer.zero_grad()
        x.grad = None
        y = run()
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()))
    for new, old in zip(*results):
        torch.testing.assert_close(new, old)
    assert (results[0][1][~active] == 0).all()  # inactive rows get no gradient
    with pytest.raises(ValueError, match="one expert; this layer has 3"):
        ExpertLinear(3, 5, 4).dense(x, active)


def test_one_expert_layers_run_without_router_or_routed_op(monkeypatch):
    """With E = 1 MoE-FFD and MoMHA call neither their router nor ``sut::routed_linear``:
    the active rows go through ``masked_affine`` (one GEMM each), the others give 0
    (MoMHA: its shared b_o)."""
    import sut_fairseq.modules.expert_linear as expert_linear

    def refuse(*args, **kwargs):
        raise AssertionError("routed with one expert")

    monkeypatch.setattr(expert_linear, "routed_linear", refuse)
    monkeypatch.setattr(Router, "forward", refuse)
    active = torch.tensor([[True, False, True, True], [False, True, True, True]])
    ffd = _ffd(1, 1)
    y = ffd(torch.randn(2, 4, 6, dtype=torch.float64), active)
    assert (y[~active] == 0).all() and (y[active] != 0).all()
    m = _momha(1, 1, relative="clipped", causal=True)
    K, V = m.project_kv(torch.randn(2, 4, 6, dtype=torch.float64))
    y = m(torch.randn(2, 4, 6, dtype=torch.float64), K, V, active)
    torch.testing.assert_close(y[~active], m.o_proj.bias.expand(2, 6).detach())


def test_router_rejects_bad_k():
    with pytest.raises(ValueError, match="k=5, E=4"):
        Router(8, 4, 5, 8)


def test_sampled_topk_keeps_distinct_experts_and_greedy_part():
    torch.manual_seed(0)
    r = Router(8, 6, 3, 8, sample_topk=1).train()
    x = torch.randn(50, 8)
    routing = r(x, torch.ones(50, dtype=torch.bool))
    idx = routing.expert_idxs
    assert all(len(set(row.tolist())) == 3 for row in idx)
    top2 = torch.softmax(r.fc2(torch.tanh(r.fc1(x))), -1).topk(2).indices
    assert torch.equal(idx[:, :2], top2)
    r.eval()
    assert torch.equal(r(x, torch.ones(50, dtype=torch.bool)).expert_idxs,
                       torch.softmax(r.fc2(torch.tanh(r.fc1(x))), -1).topk(3).indices)


# --- construction and the eager CPU saving of MoEFeedForward, the expert initialisation --


def test_moe_ffd_passes_its_router_options_and_defaults_to_relu():
    import fairseq.utils

    ffd = MoEFeedForward(8, 16, 4, 2, 8, gating_dropout=0.3, sample_topk=1)
    assert ffd.router.dropout.p == 0.3 and ffd.router.sample_topk == 1
    assert ffd.router.num_experts == 4 and ffd.router.top_k == 2
    assert MoEFeedForward(8, 16, 4, 2, 8).activation_fn is fairseq.utils.get_activation_fn("relu")


def test_moe_ffd_activation_sees_only_the_routed_rows_on_an_eager_cpu():
    """The eager CPU path applies the activation to the routed slots only (the no-op slots
    of inactive rows are cut off before it), and the output is the same as with every row."""
    torch.manual_seed(0)
    ffd = MoEFeedForward(8, 16, 4, 2, 8)
    x = torch.randn(10, 8)
    active = torch.tensor([True, False] * 5)
    seen = []
    relu = ffd.activation_fn

    def recording(h):
        seen.append(h.size(0))
        return relu(h)

    ffd.activation_fn = recording
    y = ffd(x, active)
    assert seen == [int(active.sum()) * 2]  # k = 2 slots per active row, none for the rest
    assert torch.equal(y[~active], torch.zeros(5, 8))
    for i in range(10):  # each active row alone gives the same output
        if active[i]:
            torch.testing.assert_close(ffd(x[i:i + 1], active[i:i + 1])[0], y[i])


def test_moe_ffd_compiles_without_a_graph_break():
    """Under ``torch.compile`` the row count is not read on the host (it would break the
    graph): fullgraph tracing of the layer succeeds."""
    import torch._dynamo

    torch._dynamo.reset()
    ffd = MoEFeedForward(8, 16, 4, 2, 8)
    x, active = torch.randn(6, 8), torch.tensor([True, True, False, True, False, True])
    eager = ffd(x, active)  # an eager call too: mutation testing maps tests by their eager calls
    explained = torch._dynamo.explain(ffd)(x, active)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(ffd, backend="eager", fullgraph=True)(x, active), eager)


def test_expert_weight_init_is_xavier_uniform_per_expert():
    """U(-b, b) with b = sqrt(6 / (fan_in + fan_out)), fan_in = size(1), fan_out = size(2)
    (in != out, so swapping them changes b)."""
    from sut_fairseq.modules.expert_linear import init_expert_weight_

    torch.manual_seed(0)
    w = torch.empty(3, 40, 200)
    assert init_expert_weight_(w) is w
    bound = math.sqrt(6.0 / 240)
    assert w.abs().max() <= bound
    assert w.max() > 0.99 * bound and w.min() < -0.99 * bound
    assert abs(w.mean().item()) < 0.01 * bound
    assert abs(w.var().item() - bound ** 2 / 3) < 0.02 * bound ** 2


# --- MoMHA: dtypes, devices, relative terms without a mask, attention dropout ----------


def test_mask_bias_is_minus_inf_on_hidden_keys_in_the_dtype_and_device():
    from sut_fairseq.modules.momha import mask_bias

    hidden = torch.tensor([[True, False, True]])
    bias = mask_bias(hidden, torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias, torch.tensor([[float("-inf"), 0.0, float("-inf")]], dtype=torch.bfloat16))
    assert mask_bias(hidden.to("meta"), torch.float32).device.type == "meta"
    assert mask_bias(None, torch.float32) is None


@pytest.mark.parametrize("relative", [None, "t5", "clipped"])
def test_momha_runs_in_bfloat16_with_a_padding_mask(relative):
    """A bf16 layer (fairseq's --bf16 casts the model) gives a bf16 output close to the
    fp64 layer's: the mask and relative biases are made in the queries' dtype
    (``scaled_dot_product_attention`` refuses a bias of another dtype)."""
    m = _momha(4, 2, relative=relative)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    active = torch.ones(2, 4, dtype=torch.bool)
    kpm = torch.tensor([[False, False, False, True], [True, False, False, False]])
    want = m(x, *m.project_kv(x), active, key_padding_mask=kpm)
    b = m.to(torch.bfloat16)
    got = b(x.bfloat16(), *b.project_kv(x.bfloat16()), active, key_padding_mask=kpm)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.1)


@pytest.mark.parametrize("relative", ["t5", "clipped"])
def test_attention_bias_with_relative_terms_and_no_mask(relative):
    """Without a mask (no padding, not causal) the bias is the relative term alone: for T5
    the bucket bias of each (query, key) pair, repeated over the k picks of a position."""
    m = _momha(2, 2, relative=relative)
    B, T, k, S, H, D = 1, 3, 2, 3, 2, 3
    q = torch.randn(B, H, T * k, D, dtype=torch.float64)
    bias = m._attention_bias(q, T, 0, S, None)
    assert bias.dtype == torch.float64 and bias.shape[-2:] == (T * k, S)
    if relative == "t5":
        rel = m.relative(T, 0, S)  # (1, H, T, S)
        torch.testing.assert_close(bias, rel.repeat_interleave(k, 2).double())
    else:  # q_m · r_{clip(j - i_m)} / sqrt(D)
        torch.testing.assert_close(bias, m.relative(q, T, 0, S) * D ** -0.5)


def test_momha_relative_terms_follow_the_queries_device():
    """The relative position indices are made on the queries' device (meta here)."""
    for relative in ("t5", "clipped"):
        m = _momha(2, 2, relative=relative).to("meta")
        q = torch.empty(1, 2, 6, 3, dtype=torch.float64, device="meta")
        kv = torch.empty(1, 2, 3, 3, dtype=torch.float64, device="meta")
        assert m._attention_bias(q, 3, 0, 3, None).device.type == "meta"
        if relative == "clipped":
            assert m._attend_clipped(q, kv, kv, 3, 0, None).device.type == "meta"


@pytest.mark.parametrize("relative", ["clipped", "t5"])
def test_momha_attention_dropout_only_in_training_and_only_when_p_is_positive(relative):
    """Attention probabilities are dropped with p in training (outputs vary from call to
    call), never in evaluation, and not at all at p = 0: in the CPU clipped-relative path
    (plain tensor operations) and in ``scaled_dot_product_attention`` (T5 bias)."""
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    active = torch.ones(2, 5, dtype=torch.bool)

    def run(m, seed):
        torch.manual_seed(seed)
        return m(x, *m.project_kv(x), active)

    m = _momha(3, 2, relative=relative)
    m.attention_dropout = 0.3
    m.train()
    assert not torch.allclose(run(m, 1), run(m, 2))
    m.eval()
    reference = run(m, 1)
    assert torch.equal(run(m, 2), reference)
    m.attention_dropout = 0.0
    m.train()
    torch.testing.assert_close(run(m, 3), reference)


@pytest.mark.parametrize("relative", ["clipped", "t5"])
def test_momha_attention_dropout_uses_the_layers_probability(relative, monkeypatch):
    """The probability handed to the dropout is the layer's ``attention_dropout``."""
    seen = []
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, *a, **k: seen.append(p) or dropout(x, p, *a, **k))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(k.get("dropout_p")) or sdpa(*a, **k))
    m = _momha(3, 2, relative=relative).train()
    m.attention_dropout = 0.3
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    m(x, *m.project_kv(x), torch.ones(1, 4, dtype=torch.bool))
    assert seen == [0.3]


@pytest.mark.parametrize("relative", [None, "t5"])
def test_momha_attention_bias_in_the_queries_dtype(relative):
    """The mask and relative bias handed to ``scaled_dot_product_attention`` are in the
    queries' dtype (bf16 queries of an fp64 layer, as under autocast; fused GPU kernels
    refuse a bias of another dtype)."""
    m = _momha(2, 2, relative=relative)
    q = torch.randn(2, 2, 6, 3, dtype=torch.bfloat16)
    hidden = torch.tensor([[False, False, True]])[:, None, None, :]
    assert m._attention_bias(q, 3, 0, 3, hidden).dtype == torch.bfloat16


@pytest.mark.parametrize("relative", [None, "t5", "clipped"])
def test_momha_casts_keys_and_values_to_the_queries_dtype(relative):
    """Keys/values of another dtype (fp32 here, fp64 queries) are cast to the queries'
    dtype: the same output as with fp64 keys/values rounded through fp32."""
    m = _momha(4, 2, relative=relative)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    active = torch.ones(2, 4, dtype=torch.bool)
    k, v = m.project_kv(x)
    k32, v32 = k.float(), v.float()
    got = m(x, k32, v32, active)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, m(x, k32.double(), v32.double(), active))
    b = m.to(torch.bfloat16)  # a bf16 layer with fp32 keys/values: cast down, not promoted
    got = b(x.bfloat16(), k32, v32, active)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, b(x.bfloat16(), k32.bfloat16(), v32.bfloat16(), active))


def test_momha_clipped_relative_positions_take_the_plain_path_on_a_cpu(monkeypatch):
    """On a CPU, clipped relative positions use ``_attend_clipped`` (plain tensor
    operations), not ``scaled_dot_product_attention`` with a bias."""
    m = _momha(3, 2, relative="clipped")
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    calls = []
    plain = m._attend_clipped
    monkeypatch.setattr(m, "_attend_clipped", lambda *a: calls.append(1) or plain(*a))
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("fused path"))
    m(x, *m.project_kv(x), torch.ones(1, 4, dtype=torch.bool))
    assert calls == [1]


def _hidden_keys_loop(T, picks, q_start, S, causal, pad):
    """hidden_keys by hand: query row m = t·picks + j (position q_start + t) may not see
    key s when causal and s > q_start + t, or when s is padding, unless every key the row
    could see is padding (then the padding mask is dropped for that row)."""
    B = pad.size(0)
    out = torch.zeros(B, T * picks, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            i = q_start + t
            visible = [s for s in range(S) if not (causal and s > i)]
            blind = all(bool(pad[b, s]) for s in visible)
            for j in range(picks):
                for s in range(S):
                    out[b, t * picks + j, s] = (causal and s > i) or (bool(pad[b, s]) and not blind)
    return out


@pytest.mark.parametrize("causal,q_start,T", [(False, 0, 4), (True, 0, 4), (True, 2, 2)])
def test_hidden_keys_against_a_loop(causal, q_start, T):
    """Two picks per position, rows with left padding, an all-padding row (B = 3, so a
    reduction over the wrong dimension shows), queries starting at q_start."""
    from sut_fairseq.modules.momha import hidden_keys

    S, picks = 4, 2
    pad = torch.tensor([[True, True, False, False], [True, True, True, True],
                        [False, False, False, False]])
    got = hidden_keys(T, picks, q_start, S, causal, pad, torch.device("cpu"))  # broadcastable
    assert torch.equal(got.expand(3, 1, T * picks, S)[:, 0], _hidden_keys_loop(T, picks, q_start, S, causal, pad))


def test_hidden_keys_on_the_given_device():
    from sut_fairseq.modules.momha import hidden_keys

    meta = torch.device("meta")
    pad = torch.zeros(2, 3, dtype=torch.bool, device=meta)
    assert hidden_keys(3, 2, 0, 3, True, pad, meta).device == meta
    assert hidden_keys(3, 1, 0, 3, True, None, meta).device == meta
    m = _momha(2, 2, causal=True).to("meta")
    q = torch.empty(1, 2, 6, 3, device=meta)
    assert m._hidden_keys(q, 3, 0, 3, None).device == meta


def test_momha_construction_options():
    """The router gets the gating options; relative terms: none by default, clipped with
    window 0 unless given, T5 buckets bidirectional unless causal; the k/v projections
    start Xavier-uniform with gain 2^-1/2; a bad relative kind is refused by name."""
    m = MixtureOfMultiHeadAttention(256, 256, 4, 2, 4, 64, 8, gating_dropout=0.3, sample_topk=1)
    assert m.router.dropout.p == 0.3 and m.router.sample_topk == 1
    assert m.relative is None and m.causal is False
    bound = 2 ** -0.5 * math.sqrt(6.0 / (256 + 256))
    for proj in (m.k_proj, m.v_proj):
        assert proj.weight.abs().max() <= bound and proj.weight.abs().max() > 0.99 * bound
    assert MixtureOfMultiHeadAttention(6, 6, 2, 1, 2, 3, 4, relative="clipped").relative.window == 0
    assert MixtureOfMultiHeadAttention(6, 6, 2, 1, 2, 3, 4, relative="t5").relative.bidirectional is True
    assert MixtureOfMultiHeadAttention(6, 6, 2, 1, 2, 3, 4, relative="t5", causal=True).relative.bidirectional is False
    with pytest.raises(ValueError) as err:
        MixtureOfMultiHeadAttention(6, 6, 2, 1, 2, 3, 4, relative="rotary")
    assert str(err.value) == "relative position must be None, 'clipped' or 't5'; got 'rotary'"


# --------------------------------------------------------------------------- ExpertLinear

def test_expert_linear_describes_itself_and_renames_old_checkpoint_keys():
    """``ExpertLinear``'s repr names its shape; ``rename_parameters`` moves
    ``PREFIX.old`` to ``PREFIX.new`` in place (checkpoints written before ExpertLinear),
    without a prefix too, and leaves every other key as it is."""
    from sut_fairseq.modules.expert_linear import ExpertLinear, rename_parameters

    assert "experts=3, in=4, out=5, shared_bias=False" in repr(ExpertLinear(3, 4, 5))
    assert "experts=2, in=6, out=7, shared_bias=True" in repr(ExpertLinear(2, 6, 7, shared_bias=True))
    w1, b1, other = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    state = {"enc.ffd.w1": w1, "enc.ffd.b1": b1, "enc.ffd.norm": other, "w1": other}
    rename_parameters(state, "enc.ffd", {"w1": "up.weight", "b1": "up.bias", "w2": "down.weight"})
    assert state == {"enc.ffd.up.weight": w1, "enc.ffd.up.bias": b1, "enc.ffd.norm": other, "w1": other}
    top = {"w1": w1, "x": other}
    rename_parameters(top, "", {"w1": "up.weight"})
    assert top == {"up.weight": w1, "x": other}
