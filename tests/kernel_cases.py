"""The routed-linear problems that the kernel tests share (``kernels/test_kernels_interpret.py``
on the CPU in Triton's interpreter, ``gpu/test_gpu.py`` on a CUDA device): named routing
patterns, the four uses MoE-FFD and MoMHA make of the op, and the tolerance check."""
import torch

IN_DIM, OUT_DIM = 20, 24  # not multiples of the interpreter's 16-wide blocks


def routing_indices(name: str, g: torch.Generator):
    """(expert_idxs (N, k) with E = halted/padding, E) for a named routing pattern."""
    def top_k(N, E, k, weights=None):
        weights = torch.ones(E) if weights is None else torch.tensor(weights, dtype=torch.float)
        return torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(N)])

    if name == "ragged":  # uneven loads, expert 3 empty, two halted tokens
        idx = top_k(11, 5, 2, [6.0, 1.0, 3.0, 0.0, 0.5])
        idx[[2, 7]] = 5
        return idx, 5
    if name == "multi_tile":  # several row tiles per expert, several column tiles
        idx = top_k(40, 3, 2)
        idx[5] = 3
        return idx, 3
    if name == "k1":
        idx = top_k(6, 3, 1, [1.0, 0.0, 2.0])
        idx[4] = 3
        return idx, 3
    if name == "kE":
        idx = top_k(5, 3, 3)
        idx[1] = 3
        return idx, 3
    if name == "all_halted":
        return torch.full((4, 2), 3), 3
    if name == "single_row":  # one decoding step
        return top_k(1, 4, 2), 4
    raise KeyError(name)


ROUTINGS = ["ragged", "multi_tile", "k1", "kE", "all_halted", "single_row"]

# use -> (rows of x, keyword arguments, has bias); the four calls MoE-FFD and MoMHA make
USES = {
    "ffd_up": ("token", dict(grouped_out=True), True),      # token rows in, fan_out=k, sorted out
    "ffd_down": ("sorted", dict(grouped_in=True), True),    # sorted rows in, gated sum out
    "momha_q": ("token", dict(), True),                      # token rows in, slot rows out
    "momha_out": ("slot", dict(), False),                    # slot rows in, fan_out=1, gated sum
}
GATED = {"ffd_down", "momha_out"}


NAMES = ["output", "grad x", "grad weight", "grad bias", "grad gates"]


def assert_match(got, want, tol):
    """Every tensor within ``tol`` relative to its largest reference entry (fp32: tight)."""
    for name, a, e in zip(NAMES, got, want):
        assert (a is None) == (e is None), name
        if a is None:
            continue
        assert a.shape == e.shape, (name, a.shape, e.shape)
        a, e = a.float(), e.float()
        scale = max(1.0, e.abs().max().item())
        err = (a - e).abs().max().item() if a.numel() else 0.0
        assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


def three_steps(fn, use: str, seed=0, activation: str = "", in_recurrence: bool = True):
    """One parameter (W, b) shared by three recurrence steps of ``use`` over N = 11 tokens,
    k = 2 of E = 4 experts: ragged loads with an empty expert and two halted tokens, other
    loads, then every slot halted; each step its own rows and gates; steps 2 and 3 read
    step 1's output (so that autograd runs step 1's backward last, as in the recurrence),
    and ``weight_grads.ROLE`` says which step runs (None without ``in_recurrence``: each call
    its own weight gradient, summed by autograd); with ``activation`` the map reads its
    input as act(x) ⊙ keep / 0.7, a mask of its own per step. Returns [Σ_l <dy_l, y_l>, dW,
    db, [dx_l], [dgates_l]] for that loss."""
    from sut_fairseq.ops import weight_grads
    from sut_fairseq.ops.routing import make_routing

    g = torch.Generator().manual_seed(seed)
    rows, kwargs, has_bias = USES[use]
    E, N, k = 4, 11, 2
    w = (torch.randn(E, IN_DIM, OUT_DIM, generator=g) / IN_DIM ** 0.5).requires_grad_()
    b = torch.randn(E, OUT_DIM, generator=g).requires_grad_() if has_bias else None
    loss, xs, gate_leaves, first, tag = 0.0, [], [], None, weight_grads.new_tag()
    for step, loads in enumerate(([6.0, 1.0, 3.0, 0.0], [1.0, 2.0, 2.0, 1.0], None), 1):
        if loads is None:
            idx = torch.full((N, k), E)
        else:
            idx = torch.stack([torch.multinomial(torch.tensor(loads), k, generator=g) for _ in range(N)])
            idx[[2, 7]] = E
        gates = torch.rand(N, k, generator=g)
        gates = (gates / gates.sum(1, keepdim=True) * (idx < E)).requires_grad_()
        routing = make_routing(idx, gates.detach(), E)
        x = torch.randn(N if rows == "token" else N * k, IN_DIM, generator=g).requires_grad_()
        x_in = x if first is None else x + 0.0 * first  # step l > 1 reads step 1's output
        act = {}
        if activation:  # the map's input act(x) ⊙ keep / 0.7, x's gradient by the op
            from sut_fairseq.ops.routed_linear import activated

            act = dict(activation=activation, pre=x_in, keep=torch.rand(x.shape, generator=g) >= 0.3,
                       keep_scale=1 / 0.7)
            x_in = activated(x_in.detach(), activation, act["keep"], act["keep_scale"])[0]
        weight_grads.ROLE.step = step if in_recurrence else None
        try:
            y = fn(x_in, w, b, routing, gates=gates if use in GATED else None,
                   fan_out=k if rows == "token" else 1, tag=tag, **kwargs, **act)
        finally:
            weight_grads.ROLE.step = None
        first = y.sum() if first is None else first
        loss = loss + (y * torch.randn(y.shape, generator=g)).sum()
        xs.append(x)
        gate_leaves.append(gates)
    loss.backward()
    return [loss.detach(), w.grad, None if b is None else b.grad, [x.grad for x in xs],
            [q.grad if use in GATED else None for q in gate_leaves]]
