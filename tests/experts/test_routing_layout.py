"""The sorted routing layout (``sut_fairseq/ops/routing.py``) against a straightforward
reference: every field of ``make_routing`` for random top-k choices with no-op slots,
the stable order inside each expert, and the shape checks with their message."""
import pytest
import torch

from sut_fairseq.ops.routing import make_routing


def reference_layout(expert_idxs, num_experts):
    """Python's stable ``sorted`` of the slots by expert: the sorted experts (M,), the slot
    of each sorted row (M,), and per expert e < E the end offset of its rows (E,)."""
    flat = expert_idxs.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda s: flat[s])
    offsets, end = [], 0
    for e in range(num_experts):
        end += flat.count(e)
        offsets.append(end)
    return [flat[s] for s in order], order, offsets


@pytest.mark.parametrize("N,k,E", [(1, 1, 1), (7, 2, 3), (100, 2, 4), (60, 4, 24)])
def test_make_routing_matches_a_reference(N, k, E):
    """(N, k) choices in [0, E] (E: the no-op expert of halted and padding slots): the
    layout equals the reference, within an expert the slots keep their order (stable;
    N·k = 200 and 240 are sizes where torch's unstable CPU sort reorders equal keys), and
    the no-op rows sort after ``expert_offsets[-1]``."""
    g = torch.Generator().manual_seed(N * 100 + E)
    expert_idxs = torch.randint(0, E + 1, (N, k), generator=g)
    gates = torch.rand(N, k, generator=g)
    routing = make_routing(expert_idxs, gates, E)
    sorted_experts, order, offsets = reference_layout(expert_idxs, E)
    assert routing.sorted_expert_idxs.tolist() == sorted_experts
    assert routing.sorted_scattered_idxs.tolist() == order
    assert routing.expert_offsets.tolist() == offsets
    assert routing.expert_offsets.dtype == torch.long and routing.expert_offsets.shape == (E,)
    assert routing.sorted_expert_idxs[offsets[-1]:].eq(E).all()  # no-op slots last
    assert routing.expert_idxs is expert_idxs and routing.gates is gates
    assert (routing.num_tokens, routing.k, routing.num_slots, routing.num_experts) == (N, k, N * k, E)


@pytest.mark.parametrize("N,k,E", [(7, 2, 3), (60, 4, 24)])
def test_the_compiled_counting_sort_matches_the_reference(N, k, E, monkeypatch):
    """Under torch.compile the layout is a counting sort (torch.sort is not called): traced by dynamo and AOTAutograd (``aot_eager``), every field equals the
    eager layout's and the reference, stable order included, and it is built on the
    device of its input (with the default device "meta"). (Graph breaks allowed: mutation
    testing wraps the function in a trampoline dynamo does not trace whole; the compiled
    step's ``test_no_graph_break_in_the_step`` checks that the step traces whole.)"""
    sorts, sort = [], torch.sort

    def recorded_sort(*args, **kwargs):
        sorts.append(args[0].shape)
        return sort(*args, **kwargs)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(N + E)
    expert_idxs = torch.randint(0, E + 1, (N, k), generator=g)
    gates = torch.rand(N, k, generator=g)
    eager = make_routing(expert_idxs, gates, E)
    sorted_experts, order, offsets = reference_layout(expert_idxs, E)
    monkeypatch.setattr(torch, "sort", recorded_sort)
    fields = ("expert_idxs", "gates", "sorted_expert_idxs", "sorted_scattered_idxs",
              "expert_offsets", "num_experts")
    layout = torch.compile(lambda idx, gates: tuple(getattr(make_routing(idx, gates, E), f)
                                                    for f in fields), backend="aot_eager")
    with torch.device("meta"):
        got = layout(expert_idxs, gates)
    assert sorts == [], "the compiled layout called torch.sort"
    idxs, gates_out, *fields, num_experts = got
    assert torch.equal(idxs, expert_idxs) and torch.equal(gates_out, gates) and num_experts == E
    assert [t.tolist() for t in fields] == [sorted_experts, order, offsets]
    assert [t.tolist() for t in fields] == [eager.sorted_expert_idxs.tolist(),
                                            eager.sorted_scattered_idxs.tolist(), eager.expert_offsets.tolist()]


def test_a_batch_of_no_op_slots_only_gives_empty_experts():
    expert_idxs = torch.full((3, 2), 4)
    routing = make_routing(expert_idxs, torch.zeros(3, 2), 4)
    assert routing.expert_offsets.tolist() == [0, 0, 0, 0]
    assert routing.sorted_scattered_idxs.tolist() == list(range(6))


@pytest.mark.parametrize("idx_shape,gate_shape", [((4, 2), (4, 3)), ((8,), (8,)), ((2, 2, 2), (2, 2, 2))])
def test_layouts_that_are_not_n_by_k_are_refused_with_both_shapes(idx_shape, gate_shape):
    expert_idxs = torch.zeros(idx_shape, dtype=torch.long)
    with pytest.raises(ValueError) as error:
        make_routing(expert_idxs, torch.zeros(gate_shape), 3)
    assert str(error.value) == (f"expert_idxs and gates must both be (N, k); got {idx_shape} "
                                f"and {gate_shape}")


def test_the_layout_is_built_on_the_device_of_its_input():
    """The per-expert counts are made on the routing's device, not on the default device
    (on a GPU a CPU buffer would meet CUDA indices): with the default device "meta", a CPU
    routing is still built on the CPU."""
    expert_idxs, gates = torch.tensor([[0, 2], [1, 0]]), torch.ones(2, 2)
    with torch.device("meta"):
        routing = make_routing(expert_idxs, gates, 2)
    assert routing.expert_offsets.device.type == "cpu"
    assert routing.expert_offsets.tolist() == [2, 3] and routing.sorted_scattered_idxs.tolist() == [0, 3, 2, 1]
