"""The two custom ops called eagerly, as a CPU training step calls them: ``sut::masked_linear``
and ``sut::routed_linear`` (forward, and the backward op their autograd formula calls)
against per-row / per-slot loops; which gradients the backward op is asked for (a frozen
input costs nothing); the dtypes ``masked_linear`` hands the op (autocast, a bf16 input
against an fp32 layer)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sut_fairseq.ops.masked_linear_op import masked_linear
from sut_fairseq.ops.reference_linear import reference_backward
from sut_fairseq.ops.routed_linear import reference_routed_linear, routed_linear, row_layout
from sut_fairseq.ops.routing import make_routing


class RecordDispatch(TorchDispatchMode):
    """Records every op dispatched under it: ``calls`` (name, args) of the ``sut``
    namespace's custom ops, ``ops`` (aten name, output shape) of those returning a tensor.
    (Inside a custom op only the op itself is seen.)"""

    def __init__(self):
        super().__init__()
        self.calls, self.ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "sut":
            self.calls.append((name, args))
        if isinstance(out, torch.Tensor):
            self.ops.append((name, tuple(out.shape)))
        return out


def _backward_flags(calls, name):
    """The need_* flags (the trailing bools) of the one backward op call."""
    found = [args for op, args in calls if op == name]
    assert len(found) == 1, calls
    return tuple(a for a in found[0] if isinstance(a, bool))[-4 if name == "routed_linear_backward" else -3:]


# --------------------------------------------------------------------------- sut::masked_linear

def test_masked_linear_forward_and_gradients_against_a_row_loop():
    """y_r = x_r Wᵀ + b on the selected rows, 0 elsewhere; dx_r = dy_r W on them (0
    elsewhere), dW = Σ_r dy_rᵀ x_r and db = Σ_r dy_r over the selected rows only."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(5, 3).double()
    x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    dy = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    y = masked_linear(x, linear, mask)
    y.backward(dy)
    W, b = linear.weight.detach(), linear.bias.detach()
    want_y, want_dx = torch.zeros(2, 4, 3, dtype=torch.float64), torch.zeros(2, 4, 5, dtype=torch.float64)
    want_dW, want_db = torch.zeros_like(W), torch.zeros_like(b)
    for i in range(2):
        for j in range(4):
            if mask[i, j]:
                want_y[i, j] = x[i, j].detach() @ W.t() + b
                want_dx[i, j] = dy[i, j] @ W
                want_dW += torch.outer(dy[i, j], x[i, j].detach())
                want_db += dy[i, j]
    torch.testing.assert_close(y.detach(), want_y)
    torch.testing.assert_close(x.grad, want_dx)
    torch.testing.assert_close(linear.weight.grad, want_dW)
    torch.testing.assert_close(linear.bias.grad, want_db)


@pytest.mark.parametrize("every", [False, True])
def test_masked_affine_of_a_transposed_weight_view_against_a_row_loop(every):
    """One expert's dense map (``ExpertLinear.dense``): W the transposed view of an (in, out)
    parameter. Values and gradients against the row loop; with every row selected (nothing
    halted) the body is the plain map, no gather or scatter; the backward op gives dW in
    the weight's own layout (transposed for a transposed view, so that the parameter's
    steps accumulate without copies), and a plain (out, in) weight's dW contiguous."""
    from sut_fairseq.ops.masked_linear_op import masked_affine, selected_rows_linear

    g = torch.Generator().manual_seed(2)
    P = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (in, out)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(6, dtype=torch.bool) if every else torch.tensor([True, False, True, True, False, True])
    dy = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = masked_affine(x, P.t(), b, mask)
    y.backward(dy)
    want_y, want_dx = torch.zeros(6, 3, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64)
    want_dP, want_db = torch.zeros(5, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for r in range(6):
        if mask[r]:
            want_y[r] = x[r].detach() @ P.detach() + b.detach()
            want_dx[r] = P.detach() @ dy[r]
            want_dP += torch.outer(x[r].detach(), dy[r])
            want_db += dy[r]
    for got, want in ((y.detach(), want_y), (x.grad, want_dx), (P.grad, want_dP), (b.grad, want_db)):
        torch.testing.assert_close(got, want)
    with RecordDispatch() as rec:
        selected_rows_linear(x.detach(), P.detach().t(), b.detach(), mask)
    moved = {name for name, _ in rec.ops} & {"index_select", "index_copy", "index_copy_"}
    assert bool(moved) != every, rec.ops
    _, dW, _ = torch.ops.sut.masked_linear_backward(dy, x.detach(), P.detach().t(), mask, True, True, True)
    assert dW.shape == (3, 5) and dW.t().is_contiguous() and not dW.is_contiguous()
    _, dW, _ = torch.ops.sut.masked_linear_backward(dy, x.detach(), P.detach().t().contiguous(), mask,
                                                    True, True, True)
    assert dW.is_contiguous()
    torch.testing.assert_close(dW.t(), want_dP)


@pytest.mark.parametrize("frozen", ["x", "weight", "bias", "no bias"])
def test_masked_linear_asks_for_the_gradients_needed_only(frozen):
    """The backward op is told which gradients autograd needs (need_x, need_w, need_b): a
    frozen input or a layer without a bias costs nothing; the gradients given are right."""
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(4, 3, bias=frozen != "no bias")
    x = torch.randn(5, 4, generator=g, requires_grad=frozen != "x")
    mask = torch.tensor([True, False, True, True, False])
    if frozen == "weight":
        linear.weight.requires_grad_(False)
    if frozen == "bias":
        linear.bias.requires_grad_(False)
    with RecordDispatch() as rec:
        out = masked_linear(x, linear, mask)
        out.sum().backward()
    flags = _backward_flags(rec.calls, "masked_linear_backward")
    assert flags == (frozen != "x", frozen != "weight", frozen not in ("bias", "no bias"))
    assert (x.grad is None) == (frozen == "x")
    assert (linear.weight.grad is None) == (frozen == "weight")
    if linear.bias is not None:
        assert (linear.bias.grad is None) == (frozen == "bias")
    if frozen != "x":
        torch.testing.assert_close(x.grad, mask.float().unsqueeze(1) * linear.weight.detach().sum(0))
    if frozen != "weight":
        torch.testing.assert_close(linear.weight.grad, x.detach()[mask].sum(0).expand(3, 4))


def test_masked_linear_computes_in_the_inputs_dtype_or_autocasts():
    """A bf16 input through an fp32 layer computes in bf16 (as ``F.linear`` would refuse
    the mix, the layer is cast to the input); under CPU autocast (bf16) an fp32 input
    and layer compute in bf16, as ``nn.Linear`` does there."""
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(6, 4)
    mask = torch.tensor([True, True, False])
    x = torch.randn(3, 6, generator=g)
    want = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
    y = masked_linear(x.bfloat16(), linear, mask)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y[:2], want[:2]) and torch.testing.assert_close(y[2], torch.zeros_like(y[2]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = masked_linear(x, linear, mask)
        reference = linear(x)
    assert auto.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(auto[:2], reference[:2])


# --------------------------------------------------------------------------- sut::routed_linear

E, K, N, IN, OUT = 4, 2, 5, 4, 6


def _routing(seed=0, heavy_last=False):
    """N tokens, k = 2 slots each over E = 4 experts, expert 3 chosen by no slot; token 3
    halted (both slots no-op) and token 1's second slot no-op. ``heavy_last``: expert 3
    takes more slots (5) than the others together (2)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[0, 2], [1, E], [2, 0], [E, E], [1, 2]])
    if heavy_last:
        idx = torch.tensor([[3, 0], [3, E], [3, 1], [E, E], [3, 3]])
    gates = torch.rand(N, K, generator=g, dtype=torch.float64) * idx.lt(E)
    return make_routing(idx, gates, E), idx, gates


def _slot_loop(x, weight, bias, idx, fan_out, gates=None):
    """y_s = x[s // fan_out] W[e_s] + b[e_s] per slot s (0 for a no-op slot); with gates
    the gate-weighted sum of each token's slots."""
    y = torch.zeros(N * K, OUT, dtype=x.dtype)
    flat = idx.reshape(-1)
    for s in range(N * K):
        e = int(flat[s])
        if e < E:
            y[s] = x[s // fan_out] @ weight[e] + (0 if bias is None else bias[e])
    if gates is None:
        return y
    return (y.view(N, K, OUT) * gates.unsqueeze(2)).sum(1)


@pytest.mark.parametrize("heavy_last", [False, True])
@pytest.mark.parametrize("layout", ["token rows, gates", "token rows", "slot rows", "grouped in and out"])
def test_routed_linear_op_forward_and_gradients_against_a_slot_loop(layout, heavy_last):
    """The op called as the expert layers call it, forward and backward (every operand's
    gradient, the gates' included), against autograd through a per-slot loop."""
    routing, idx, gates = _routing(heavy_last=heavy_last)
    g = torch.Generator().manual_seed(3)
    fan_out = 1 if layout == "slot rows" else K
    rows = N if fan_out == K else N * K
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(E, IN, OUT, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, OUT, generator=g, dtype=torch.float64, requires_grad=True)
    gate_in = gates.clone().requires_grad_() if layout == "token rows, gates" else None
    grouped = layout == "grouped in and out"
    order = routing.sorted_scattered_idxs
    if grouped:     # the input rows in sorted order: sorted row r is slot order[r]
        x_slots = torch.randn(N * K, IN, generator=g, dtype=torch.float64)
        x = x_slots[order].clone().requires_grad_()
    y = routed_linear(x, weight, bias, routing, fan_out, grouped, grouped, gate_in)
    if grouped:
        slot_input = torch.zeros_like(x).index_copy(0, order, x)
        want = _slot_loop(slot_input, weight, bias, idx, 1)[order]
    else:
        want = _slot_loop(x, weight, bias, idx, fan_out, gate_in)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(y, want)
    inputs = [x, weight, bias] + ([gate_in] if gate_in is not None else [])
    got = torch.autograd.grad(y, inputs, dy)
    expected = torch.autograd.grad(want, inputs, dy)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("frozen", ["x", "weight", "bias", "gates", "no bias", "no gates"])
def test_routed_linear_op_asks_for_the_gradients_needed_only(frozen):
    """need_x, need_w, need_b, need_g as autograd needs them: a frozen operand, a missing
    bias or missing gates cost nothing in the backward op; the gradients autograd gets
    are the needed ones (None for the frozen)."""
    routing, idx, gates = _routing(1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, IN, generator=g, requires_grad=frozen != "x")
    weight = torch.randn(E, IN, OUT, generator=g, requires_grad=frozen != "weight")
    bias = None if frozen == "no bias" else torch.randn(E, OUT, generator=g, requires_grad=frozen != "bias")
    gate_in = None if frozen == "no gates" else gates.float().requires_grad_(frozen != "gates")
    with RecordDispatch() as rec:
        y = routed_linear(x, weight, bias, routing, K, False, False, gate_in)
        y.sum().backward()
    assert _backward_flags(rec.calls, "routed_linear_backward") == (
        frozen != "x", frozen != "weight", frozen not in ("bias", "no bias"), frozen not in ("gates", "no gates"))
    backward = [args for op, args in rec.calls if op == "routed_linear_backward"][0]
    forward = [args for op, args in rec.calls if op == "routed_linear"][0]
    # the backward op gets the forward's operands and routing tensors, in the same places
    for a, b in zip(backward[1:12], forward):
        assert a is b or (isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)), (a, b)
    for t, name in ((x, "x"), (weight, "weight"), (bias, "bias"), (gate_in, "gates")):
        if t is not None:
            assert (t.grad is None) == (frozen == name), name


def test_routed_linear_op_in_bf16_with_fp32_gates():
    """bf16 operands (as ``routed_linear`` hands them over under bf16 training) with the
    router's fp32 gates: the output in bf16, each gradient in its operand's dtype, the
    values those of the float64 slot loop to bf16 rounding."""
    routing, idx, gates = _routing(2)
    g = torch.Generator().manual_seed(5)
    x64 = torch.randn(N, IN, generator=g, dtype=torch.float64)
    w64 = torch.randn(E, IN, OUT, generator=g, dtype=torch.float64)
    b64 = torch.randn(E, OUT, generator=g, dtype=torch.float64)
    dy = torch.randn(N, OUT, generator=g, dtype=torch.float64)
    x, w, b = (t.bfloat16().requires_grad_() for t in (x64, w64, b64))
    gate_in = gates.float().requires_grad_()
    y = routed_linear(x, w, b, routing, K, False, False, gate_in)
    y.backward(dy.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype, gate_in.grad.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b, gate_in)]
    want = _slot_loop(*ref_in[:3], idx, K, ref_in[3])
    want.backward(dy.bfloat16().double())
    torch.testing.assert_close(y.double(), want, rtol=0.02, atol=0.05)
    for got, ref in zip((x.grad, w.grad, b.grad, gate_in.grad), ref_in):
        torch.testing.assert_close(got.double(), ref.grad, rtol=0.02, atol=0.1)
    assert w.grad[3].abs().sum() == 0 and b.grad[3].abs().sum() == 0   # the expert no slot chose


def test_the_triton_branch_hands_the_kernels_the_callers_routing(monkeypatch):
    """``SUT_KERNELS=triton``: the op runs the Triton backend's forward and backward
    (recorded here in place of the kernels, which need a GPU or the interpreter) with the
    caller's routing, every field of it (the kernels read the sorted expert indices the CPU
    backend does not), and the need flags of the backward."""
    kernels = pytest.importorskip("sut_fairseq.kernels.routed_linear_triton")
    routing, idx, gates = _routing(3)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, IN, generator=g, requires_grad=True)
    weight = torch.randn(E, IN, OUT, generator=g, requires_grad=True)
    gate_in = gates.float()
    seen = {}

    def forward(x_, weight_, bias_, gates_, routing_, fan_out, grouped_in, grouped_out):
        seen["forward"] = (routing_, fan_out, grouped_in, grouped_out)
        return x_.new_zeros(N * K, OUT)  # gate-weighted slot rows

    def backward(dout, x_, weight_, bias_, gates_, routing_, fan_out, grouped_in, grouped_out,
                 dout_fan, needs, activation, pre, keep, keep_scale, acc_w, acc_b):
        seen["backward"] = (routing_, needs, tuple(dout.shape), dout_fan, activation, pre, keep)
        assert acc_w is None and acc_b is None  # one call outside a recurrence: no running sum
        return x.new_ones(N * K, IN), weight.new_ones(E, IN, OUT), None, None  # dx per slot

    monkeypatch.setattr(kernels, "triton_forward", forward)
    monkeypatch.setattr(kernels, "triton_backward", backward)
    monkeypatch.setattr(kernels, "check_operands", lambda *args: None)
    monkeypatch.setenv("SUT_KERNELS", "triton")
    y = routed_linear(x, weight, None, routing, K, False, False, gate_in)
    y.sum().backward()
    assert seen["forward"][1:] == (K, False, False)
    assert seen["backward"][4:] == ("", None, None)
    for got in (seen["forward"][0], seen["backward"][0]):
        assert got.num_experts == E
        for name in ("expert_idxs", "sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets"):
            assert torch.equal(getattr(got, name), getattr(routing, name)), name
        assert torch.equal(got.gates, gate_in)
    assert seen["backward"][1] == (True, True, False, False)
    assert seen["backward"][2:4] == ((N, OUT), K)  # the sum's gradient: one row per token, K slots
    # the K slots' input gradients of a token summed outside the backend
    assert torch.equal(x.grad, torch.full((N, IN), float(K))) and torch.equal(weight.grad, torch.ones(E, IN, OUT))


@pytest.mark.parametrize("needed", ["x", "weight", "bias", "gates"])
def test_the_reference_backward_computes_only_what_is_needed(needed):
    """One operand needs a gradient: the CPU backend's backward (``reference_backward``,
    which the op runs on a CPU) does none of the others' work (recorded op by op): no (E, in, out) weight gradient, no bias sums (``mv``) nor
    their ones vector, no gate gradient buffer, no P = G Wᵀ product (n, in) unless x or
    the gates need it, no gathered input rows unless W or the gates need them."""
    routing, idx, gates = _routing(4)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, IN, generator=g, requires_grad=needed == "x")
    weight = torch.randn(E, IN, OUT, generator=g, requires_grad=needed == "weight")
    bias = torch.randn(E, OUT, generator=g, requires_grad=needed == "bias")
    gate_in = gates.float().requires_grad_(needed == "gates")
    # the backend's backward itself (inside the custom op a dispatch mode sees only the op)
    src, dst, row_gates, ends = row_layout(routing, K, False, False, gate_in, out_fan=K)
    needs = tuple(t.requires_grad for t in (x, weight, bias, gate_in))
    with RecordDispatch() as rec:
        reference_backward(torch.ones(N, OUT), x, weight, bias, row_gates.detach(), src, dst, ends, needs)
    shapes = [shape for _, shape in rec.ops]
    active = int(routing.expert_offsets[-1])
    assert ((E, IN, OUT) in shapes) == (needed == "weight")
    assert (("mv", (OUT,)) in rec.ops) == (needed == "bias")          # Σ_rows g ⊙ G per expert
    assert (("new_ones", (active,)) in rec.ops) == (needed == "bias")
    assert (("new_empty", (active,)) in rec.ops) == (needed == "gates")   # dg per sorted row
    rows_of = {int(n) for n in torch.bincount(routing.sorted_expert_idxs, minlength=E + 1)[:E] if n}
    products = {shape for name, shape in rec.ops if name in ("mm", "matmul") and shape[1:] == (IN,)}
    assert bool(products) == (needed in ("x", "gates"))       # P = G Wᵀ, (n_e, in)
    gathered = {shape for name, shape in rec.ops if name == "index_select" and shape[1:] == (IN,)}
    assert bool(gathered) == (needed in ("weight", "gates"))  # x's rows of each expert
    assert (("new_empty", (E, OUT)) in rec.ops) == (needed == "bias")      # db
    scaled = [shape for name, shape in rec.ops if name == "mul_" and shape[1:] == (IN,)]
    assert bool(scaled) == (needed == "x")                    # dx = g ⊙ P, in place
    assert rows_of                                            # (the routing has real rows)


def test_the_reference_backend_computes_in_the_promoted_or_autocast_dtype():
    """The op on the CPU backend (and the oracle the kernels are tested against): a bf16 input with fp32 weights computes in fp32; under CPU autocast (bf16)
    fp32 operands compute in bf16; either way each gradient comes back in its operand's
    dtype and the values are the float64 loop's."""
    routing, idx, gates = _routing(5)
    g = torch.Generator().manual_seed(8)
    x64, w64, b64 = (torch.randn(*shape, generator=g, dtype=torch.float64)
                     for shape in ((N, IN), (E, IN, OUT), (E, OUT)))
    for autocast, x_dtype, expect in ((False, torch.bfloat16, torch.float32), (True, torch.float32, torch.bfloat16)):
        x, w, b = x64.to(x_dtype).requires_grad_(), w64.float().requires_grad_(), b64.float().requires_grad_()
        gate_in = gates.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = reference_routed_linear(x, w, b, routing, K, gates=gate_in)
        assert y.dtype == expect
        y.float().sum().backward()
        assert (x.grad.dtype, w.grad.dtype, b.grad.dtype, gate_in.grad.dtype) == (x_dtype,) + (torch.float32,) * 3
        ref = [t.detach().double().requires_grad_() for t in (x, w, b, gate_in)]
        want = _slot_loop(*ref[:3], idx, K, ref[3])
        want.sum().backward()
        tol = dict(rtol=0.03, atol=0.1)
        torch.testing.assert_close(y.double(), want, **tol)
        for got, r in zip((x.grad, w.grad, b.grad, gate_in.grad), ref):
            torch.testing.assert_close(got.double(), r.grad, **tol)


# --------------------------------------------------------------------------- without autograd

def test_without_autograd_the_ops_bodies_run_directly_with_the_same_result():
    """Eagerly without a gradient (decoding) ``routed_linear`` and ``masked_linear`` call the
    ops' bodies, not the custom ops (no ``sut`` call dispatched), and return what the ops
    return; with an input that needs a gradient they are the ops (a ``sut`` call, autograd)."""
    g = torch.Generator().manual_seed(3)
    routing, idx, gates = _routing()
    x = torch.randn(N, IN, generator=g, dtype=torch.float64)
    weight = torch.randn(E, IN, OUT, generator=g, dtype=torch.float64)
    bias = torch.randn(E, OUT, generator=g, dtype=torch.float64)
    linear = torch.nn.Linear(IN, OUT).double()
    mask = torch.tensor([True, False, True, True, False])
    ops = {"routed": lambda: routed_linear(x, weight, bias, routing, fan_out=K, gates=gates),
           "masked": lambda: masked_linear(x, linear, mask)}
    want = {"routed": _slot_loop(x, weight, bias, idx, K, gates),
            "masked": torch.where(mask.unsqueeze(1), linear(x), 0.0).detach()}
    for name, call in ops.items():
        with torch.no_grad(), RecordDispatch() as record:
            got = call()
        assert record.calls == [], (name, record.calls)
        torch.testing.assert_close(got, want[name])
    x.requires_grad_()
    for name, call in ops.items():
        with RecordDispatch() as record:
            got = call()
        assert [op for op, _ in record.calls] == [f"{name}_linear"] and got.requires_grad
        torch.testing.assert_close(got.detach(), want[name])


@pytest.mark.parametrize("operand", ["weight", "bias", "gates"])
def test_an_operand_alone_needing_a_gradient_gets_it(operand):
    """Any one operand that needs a gradient (the input frozen, as the routed input of a
    frozen layer) makes the call the op: the output has a gradient path to it."""
    g = torch.Generator().manual_seed(4)
    routing, idx, gates = _routing()
    tensors = dict(weight=torch.randn(E, IN, OUT, generator=g, dtype=torch.float64),
                   bias=torch.randn(E, OUT, generator=g, dtype=torch.float64), gates=gates.clone())
    tensors[operand].requires_grad_()
    x = torch.randn(N, IN, generator=g, dtype=torch.float64)
    routed_linear(x, tensors["weight"], tensors["bias"], routing, fan_out=K, gates=tensors["gates"]).sum().backward()
    assert tensors[operand].grad is not None and tensors[operand].grad.abs().sum() > 0


@pytest.mark.parametrize("operand", ["weight", "bias"])
def test_a_masked_linear_parameter_alone_needing_a_gradient_gets_it(operand):
    linear = torch.nn.Linear(IN, OUT).double().requires_grad_(False)
    getattr(linear, operand).requires_grad_()
    x = torch.randn(N, IN, dtype=torch.float64)
    masked_linear(x, linear, torch.tensor([True, False, True, True, False])).sum().backward()
    assert getattr(linear, operand).grad.abs().sum() > 0


def _triton_stand_ins(kernels, seen):
    """Plain PyTorch stand-ins for the Triton backend's two functions, with its contract
    (``routed_linear_triton``): the forward's gate-weighted slot rows (M, out); the
    backward's input gradient per slot (M, in) and the gate gradient as partial sums over
    ``max_column_tiles`` column tiles (T, M) fp32 (the bias term in tile 0). Token rows with
    gates only (fan_out = k, nothing grouped)."""

    def forward(x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out):
        y = torch.zeros(routing.num_slots, weight.size(2), dtype=x.dtype)
        for s, e in enumerate(routing.expert_idxs.reshape(-1).tolist()):
            if e < routing.num_experts:
                y[s] = gates.reshape(-1)[s] * (x[s // fan_out] @ weight[e] + bias[e])
        return y

    def backward(dout, x, weight, bias, gates, routing, fan_out, grouped_in, grouped_out,
                 dout_fan, needs, activation, pre, keep, keep_scale, acc_w, acc_b):
        assert not activation and acc_w is None and acc_b is None
        seen.append((tuple(dout.shape), dout_fan))
        M, T = routing.num_slots, kernels.max_column_tiles(weight.size(1), x.dtype, x.device)
        dx, dw, db = torch.zeros(M, x.size(1)), torch.zeros_like(weight), torch.zeros_like(bias)
        partial = torch.zeros(T, M)
        for s, e in enumerate(routing.expert_idxs.reshape(-1).tolist()):
            if e < routing.num_experts:
                dy, xs, g = dout[s // dout_fan], x[s // fan_out], gates.reshape(-1)[s]
                dx[s] = g * (dy @ weight[e].t())
                dw[e] += torch.outer(xs, g * dy)
                db[e] += g * dy
                for t, cols in enumerate(torch.arange(x.size(1)).tensor_split(T)):
                    partial[t, s] = xs[cols] @ (weight[e][cols] @ dy)
                partial[0, s] += dy @ bias[e]
        return dx, dw, db, partial

    return forward, backward


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_on_the_triton_backend_the_slot_sums_are_left_to_the_traced_graph(compiled, monkeypatch):
    """``SUT_KERNELS=triton`` (the backend's functions replaced by stand-ins with its
    contract): the op returns gate-weighted slot rows and ``routed_linear`` sums them; the
    backward op gets that sum's gradient as one row per token read by its k slots (not a
    (M, out) copy, also when traced by AOT autograd), and the autograd formula sums the
    slots' input gradients and the gate gradient's partial sums: outputs and every gradient
    equal the CPU backend's, eager and compiled (``aot_eager``)."""
    kernels = pytest.importorskip("sut_fairseq.kernels.routed_linear_triton")
    routing, idx, gates = _routing(3)
    seen = []
    forward, backward = _triton_stand_ins(kernels, seen)
    g = torch.Generator().manual_seed(8)
    inputs = [torch.randn(N, IN, generator=g), torch.randn(E, IN, OUT, generator=g),
              torch.randn(E, OUT, generator=g), gates.float()]
    dy = torch.randn(N, OUT, generator=g)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in inputs]

        def f(x, w, b, gate_in):
            return routed_linear(x, w, b, routing, K, gates=gate_in, backend=backend)

        y = (torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f)(*leaves)
        y.backward(dy)
        return [y] + [t.grad for t in leaves]

    want = run("reference")
    monkeypatch.setattr(kernels, "triton_forward", forward)
    monkeypatch.setattr(kernels, "triton_backward", backward)
    monkeypatch.setattr(kernels, "check_operands", lambda *args: None)
    got = run("triton")
    assert seen == [((N, OUT), K)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_on_the_triton_backend_no_tokens_launch_nothing_and_give_empty_results(monkeypatch):
    """Zero tokens on the Triton backend (no kernel runs, so none is needed here): the gated
    output is (0, out), the slot rows (0, out), and every gradient has its operand's shape."""
    pytest.importorskip("sut_fairseq.kernels.routed_linear_triton")
    monkeypatch.setenv("SUT_KERNELS", "triton")
    routing = make_routing(torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), E)
    x = torch.zeros(0, IN, requires_grad=True)
    weight = torch.randn(E, IN, OUT, requires_grad=True)
    bias = torch.randn(E, OUT, requires_grad=True)
    gates = torch.zeros(0, K, requires_grad=True)
    y = routed_linear(x, weight, bias, routing, K, gates=gates)
    slots = routed_linear(x, weight, bias, routing, K)
    assert y.shape == (0, OUT) and slots.shape == (0, OUT)
    (y.sum() + slots.sum()).backward()
    assert x.grad.shape == (0, IN) and gates.grad.shape == (0, K)
    assert weight.grad.abs().sum() == 0 and bias.grad.abs().sum() == 0
