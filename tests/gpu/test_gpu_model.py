"""benchmarks/gpu_model.py: the CPU model of a GPU training step (meta tensors, CUDA path)."""
from collections import Counter
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import gpu_model  # noqa: E402


def test_kernel_time_on_an_exact_example():
    """A bf16 (1, 1024, 1024, 1024) GEMM: 2^31 FLOPs, 3 x 2 MiB; and a small copy at the floor."""
    dev = gpu_model.Device("toy", bf16_tflops=100.0, hbm_tbs=1.0)
    f = gpu_model.Factors(floor_us=5.0, gemm=0.5, misaligned_gemm=0.1, routed_gemm=0.2,
                          routed_wgrad=0.1, bandwidth=0.5)
    gemm = gpu_model.Kernel("gemm", "mm", 1, 2.0 * 1024 ** 3, 3 * 2 * 1024 ** 2,
                            gemm=(1, 1024, 1024, 1024), dtype=torch.bfloat16)
    assert gpu_model.kernel_ms(gemm, dev, f) == pytest.approx(1e3 * 2 * 1024 ** 3 / 50e12)
    odd = gpu_model.Kernel("gemm", "mm", 1, 2.0 * 1024 ** 3, 3 * 2 * 1024 ** 2,
                           gemm=(1, 1024, 1024, 1023), dtype=torch.bfloat16)
    assert odd.misaligned() and not gemm.misaligned()
    assert gpu_model.kernel_ms(odd, dev, f) == pytest.approx(1e3 * 2 * 1024 ** 3 / 10e12)
    for name, eff in (("_routed_gemm", 0.2), ("_routed_wgrad", 0.1)):  # each its own factor
        routed = gpu_model.Kernel("triton", name, 1, 2.0 * 1024 ** 3, 3 * 2 * 1024 ** 2)
        assert gpu_model.kernel_ms(routed, dev, f) == pytest.approx(1e3 * 2 * 1024 ** 3 / (eff * 100e12))
    copy = gpu_model.Kernel("aten", "copy_", 2, 0.0, 4096.0)
    assert gpu_model.kernel_ms(copy, dev, f) == pytest.approx(2 * 5e-3)
    big = gpu_model.Kernel("aten", "copy_", 1, 0.0, 1e9)
    assert gpu_model.kernel_ms(big, dev, f) == pytest.approx(1e3 * 1e9 / 0.5e12)


def test_lint_flags_a_misaligned_gemm_only(capsys):
    kernels = [gpu_model.Kernel("gemm", "bmm", 1, 1.0, 1.0, gemm=(12, 4096, 63, 64), dtype=torch.bfloat16),
               gpu_model.Kernel("gemm", "mm", 1, 1.0, 1.0, gemm=(1, 4096, 64, 64), dtype=torch.bfloat16),
               gpu_model.Kernel("gemm", "mm", 1, 1.0, 1.0, gemm=(1, 4096, 63, 64), dtype=torch.float32)]
    gpu_model.print_step("toy", kernels, gpu_model.H200, 5)
    out = capsys.readouterr().out
    assert out.count("MISALIGNED") == 2  # the header and the bf16 (.., 63, ..) product
    assert "gpu model: toy launches 3 device_ms" in out and out.rstrip().endswith("misaligned_gemms 1")
    assert "compiled regions" not in out  # eager: no region


def test_a_compiled_step_is_split_inside_and_outside_its_regions(capsys):
    """Launches and ms inside the compiled regions and outside them (the eager rest)."""
    kernels = [gpu_model.Kernel("inductor", "fused 3 ops", 1, 0.0, 1.0, region=0),
               gpu_model.Kernel("gemm", "mm", 2, 1.0, 1.0, gemm=(1, 64, 64, 64), dtype=torch.bfloat16, region=1),
               gpu_model.Kernel("aten", "embedding", 4, 0.0, 1.0)]
    gpu_model.print_step("toy", kernels, gpu_model.H200, 5)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("== toy: inside / outside the compiled regions (launches, device ms)")
    inside, outside = lines[at + 1].split(), lines[at + 2].split()
    assert inside[:2] == ["inside", "3"] and outside[:2] == ["outside", "4"]
    assert float(inside[2]) == pytest.approx(gpu_model.total_ms(kernels[:2], gpu_model.H200), abs=0.005)
    assert float(outside[2]) == pytest.approx(gpu_model.total_ms(kernels[2:], gpu_model.H200), abs=0.005)


@pytest.mark.parametrize("flag", [[], ["--compile-step"]])
def test_sut_tiny_summary(capsys, flag):
    gpu_model.main(["--arch", "sut_tiny", "--batch", "4", "--len", "8", "--vocab", "200", *flag])
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("gpu model: sut_tiny")]
    m = re.fullmatch(r"gpu model: sut_tiny launches (\d+) device_ms ([\d.]+) misaligned_gemms (\d+)", lines[-1])
    assert m and int(m[1]) > 0 and float(m[2]) > 0
    # the routed kernels by name in the table by kind: forward + input gradient, weight gradient
    gemm = re.search(r"^  triton _routed_gemm +(\d+) ", out, re.M)
    wgrad = re.search(r"^  triton _routed_wgrad +(\d+) ", out, re.M)
    assert gemm and wgrad and int(gemm[1]) == 2 * int(wgrad[1]) > 0, out


def test_compiled_fuses_kernels():
    eager = gpu_model.record_step("sut_tiny", False, 4, 8, 200)
    compiled = gpu_model.record_step("sut_tiny", True, 4, 8, 200)
    assert any(k.kind == "inductor" for k in compiled) and not any(k.kind == "inductor" for k in eager)
    assert gpu_model.launches(compiled) < gpu_model.launches(eager)
    assert sum(k.kind == "triton" for k in eager) > 0


def test_the_loss_is_one_triton_pass_over_the_logits_each_way():
    """On the CUDA path the label-smoothed cross entropy is its two Triton kernels, priced
    by their bytes: the bf16 logits (N x V) read forward, read and their gradient written
    backward; no other kernel outside the steps touches an (N, V) tensor but the output
    projection's GEMMs."""
    B, T, V = 3, 5, 200  # N = 15 rows: no other tensor of the step has N x V elements
    kernels = gpu_model.record_step("sut_tiny", False, B, T, V)
    ce = {k.name: k for k in kernels if k.name.startswith("_ce_")}
    assert sorted(ce) == ["_ce_backward", "_ce_forward"]
    assert (ce["_ce_forward"].phase, ce["_ce_backward"].phase) == ("fwd", "bwd")
    logits = B * T * V * 2
    assert ce["_ce_forward"].bytes == logits + (3 * 4 + 8) * B * T  # + lse, 2 row terms; target
    assert ce["_ce_backward"].bytes == 2 * logits + (4 + 8) * B * T + 4  # + lse, target; dloss
    outside = [k for k in kernels if not k.step and k.launches and B * T * V in k.out_numels]
    assert {k.kind for k in outside} <= {"gemm"}, [(k.kind, k.name) for k in outside]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_router_is_two_triton_launches_forward_and_one_backward(compiled):
    """On the CUDA path each router's choice is ``sut::route_top_k``: ``_route_rows`` and
    ``_route_sort`` forward, ``_route_backward`` backward, one each per router call (as
    many as the last layer's weight-gradient products dz^T x, (E, D)); the logits x W^T and
    the hidden layer's gradient dz W are inside the kernels (no GEMM with E as its N or K),
    and no sort, top-k or argmax kernel is left."""
    kernels = gpu_model.record_step("sut_tiny", compiled, 4, 8, 200)
    names = Counter(k.name for k in kernels if k.launches)
    E = gpu_model.train_step.build("sut_tiny", 200, 0.0)[0].encoder.side.block.ffd.router.num_experts
    gemms = [k.gemm for k in kernels if k.kind == "gemm" and k.launches]
    calls = sum(1 for _, M, _, _ in gemms if M == E)
    assert calls > 0 and not [g for g in gemms if E in (g[2], g[3])], gemms
    assert names["_route_rows"] == names["_route_sort"] == names["_route_backward"] == calls
    assert not {"sort", "topk", "argmax"} & set(names), names


def test_the_routed_ops_leave_their_slot_sums_to_the_compiled_graph():
    """On the CUDA path the routed op's sums over a token's k slots (the gated output, the
    input gradient of token rows, the gate gradient's column tiles) are outside the opaque
    ops: a compiled step has no ``custom`` kernel left, and a sum over k < 8 slots is priced
    as inductor writes it, pointwise at its output's size, so it joins a fused kernel."""
    compiled = gpu_model.record_step("sut_tiny", True, 4, 8, 200)
    assert not [k for k in compiled if k.kind == "custom" and k.launches]
    raw = _unfused("sut_tiny")
    model = gpu_model.train_step.build("sut_tiny", 200, 0.0)[0]
    ffd = model.encoder.side.block.ffd
    k, d = ffd.router.top_k, ffd.down.weight.size(2)
    slot_sums = [r for r in raw if r.name == "sum" and r.region is not None and r.phase == "fwd"
                 and r.out_numels == (4 * 8 * d,)]
    assert slot_sums and k < gpu_model.UNROLL_REDUCTIONS_BELOW
    assert all(r.numel == 4 * 8 * d for r in slot_sums)  # iterated at the output's size


def _unfused(arch):
    """The recorded kernels of ``arch``'s compiled step before the fusion model."""
    fuse, gpu_model.fuse = gpu_model.fuse, (lambda kernels: kernels)
    try:
        return gpu_model.record_step(arch, True, 4, 8, 200)
    finally:
        gpu_model.fuse = fuse


def test_only_work_that_shares_data_fuses():
    """Between two extern kernels the fusion model fuses operations of one size that share
    data (a producer and its consumer, or two readers of one tensor) into one kernel, and
    gives unrelated work of the same size kernels of their own, as inductor does."""
    def op(name, reads, writes, numel=64):
        return gpu_model.Kernel("aten", name, 1, numel, 8.0 * numel, region=0, numel=numel,
                                reads=tuple((key, 256) for key in reads),
                                writes=tuple((key, 256) for key in writes), out_numels=(numel,))

    gemm = gpu_model.Kernel("gemm", "mm", 1, 1.0, 1.0, region=0)
    chain = [op("mul", ["a"], ["b"]), op("add", ["b"], ["c"])]        # c = a * x + y
    apart = [op("exp", ["d"], ["e"])]                                   # unrelated, same size
    shared = [op("neg", ["f"], ["g"]), op("abs", ["f"], ["h"])]        # two readers of f
    fused = [k for k in gpu_model.fuse([gemm, *chain, *apart, *shared, gemm]) if k.kind == "inductor"]
    assert sorted(k.name for k in fused) == ["fused 1 ops", "fused 2 ops", "fused 2 ops"]


def test_a_gather_is_priced_at_its_output_size():
    """Inductor writes ``gather`` as pointwise code over its output (an indirect load per
    element): the model iterates it at its output's size, so the clipped relative term's
    gather (from q·r over the offsets, larger than its output) fuses with the bias it feeds."""
    gathers = [k for k in _unfused("sut_tiny") if k.name == "gather" and k.phase == "fwd" and k.step]
    assert gathers
    for k in gathers:
        assert k.numel == max(k.out_numels)


def test_a_compiled_loop_builds_what_every_step_builds_alike_once():
    """AOT autograd removes repeated subexpressions from a compiled region's joint graph:
    in a compiled loop the relative-position indices (``arange`` of the query and key
    positions) that every step builds alike are kernels of the first step only, while each
    step's dropout masks (random) stay kernels of their own; the eager step keeps all."""
    loop, eager = _unfused("sut_tiny+loop"), gpu_model.record_step("sut_tiny", False, 4, 8, 200)

    def counts(kernels, name):
        found = [k for k in kernels if k.name == name and k.phase == "fwd" and k.step]
        return len(found), sum(1 for k in found if k.launches)

    runs, launched = counts(loop, "arange")
    assert runs > 2 and 0 < launched < runs
    assert counts(eager, "arange") == (runs, runs)
    steps_with_arange = {k.step for k in loop if k.name == "arange" and k.launches and k.step}
    assert steps_with_arange <= {"enc1", "dec1"}, steps_with_arange
    runs, launched = counts(loop, "bernoulli_")
    assert runs > 0 and launched == runs


def test_a_compiled_loop_sums_each_parameters_step_gradients_in_one_kernel(monkeypatch):
    """``--compile-step``: the engine adds a shared parameter's gradient of every step
    after the first (an ``accum`` launch each); ``--compile-loop``: the sums are inside the
    loop's graph, one kernel per parameter (and side) that reads every step's gradient
    (a weight-gradient product per step here), and none for the expert weights, whose
    weight-gradient launches add the running sum themselves (``weight_grads``)."""
    monkeypatch.setenv("SUT_WEIGHT_GRADS", "per-step")
    step = gpu_model.record_step("sut_tiny", True, 4, 8, 200)
    loop = gpu_model.record_step("sut_tiny+loop", True, 4, 8, 200)

    def accum(kernels):
        return [k for k in kernels if k.kind == "accum"]

    model = gpu_model.train_step.build("sut_tiny", 200, 0.0)[0]
    shared = sum(len(list(side.parameters())) for side in (model.encoder.side, model.decoder.side))
    # the expert weights and per-expert biases the routed op sees, and their adds per step
    routed_adds = sum((side.num_steps - 1) * sum(
        1 for m in side.modules() if type(m).__name__ == "ExpertLinear" and m.weight.size(0) > 1
        for p in (m.weight, m.bias) if p is not None and p.dim() > 1)
        for side in (model.encoder.side, model.decoder.side))
    assert routed_adds > 0
    assert len(accum(step)) - routed_adds == len(accum(loop)) > shared  # the rest recorded ...
    launched = sum(k.launches for k in accum(loop))
    # ... few launched: one per side parameter at most, and the tied embeddings' sum
    # outside the loops (as the transformer's one)
    assert 0 < launched <= shared + 1 < sum(k.launches for k in accum(step))
    assert sum(k.bytes for k in accum(loop)) < sum(k.bytes for k in accum(step))


@pytest.mark.parametrize("form", ["sut_tiny", "sut_tiny+loop"])
def test_the_shared_expert_weights_get_one_weight_gradient_launch_each(form, monkeypatch):
    """On the Triton path under ``SUT_WEIGHT_GRADS=deferred`` each routed parameter's gradient is one
    ``_routed_wgrad`` launch per backward over every step's rows, eager and in a compiled
    loop; per step there is one per step; the products' FLOPs are the same."""
    model = gpu_model.train_step.build("sut_tiny", 200, 0.0)[0]
    routed = sum(1 for m in model.modules() if type(m).__name__ == "ExpertLinear" and m.weight.size(0) > 1)

    def wgrad(choice):
        monkeypatch.setenv("SUT_WEIGHT_GRADS", choice)
        ks = [k for k in gpu_model.record_step(form, form.endswith("+loop"), 4, 8, 200)
              if k.kind == "triton" and k.name == "_routed_wgrad"]
        return sum(k.launches for k in ks), sum(k.flops for k in ks if k.launches)

    (deferred, flops_deferred), (per_step, flops_per_step) = wgrad("deferred"), wgrad("per-step")
    assert deferred == routed < per_step
    assert flops_deferred == flops_per_step


def test_a_loops_gemm_made_weight_gradients_are_summed_in_their_gemms():
    """In one compiled loop graph a shared weight's step gradient made by a GEMM takes the
    running sum as the GEMM's input (``addmm``, benchmarks/inductor_accumulation.py): no
    kernel of its own; a LayerNorm weight's gradient (a reduction) keeps its sum kernel.
    Eagerly (no region) every extra use's add is a launch."""
    torch.manual_seed(0)
    linear, norm = torch.nn.Linear(8, 8).to("meta"), torch.nn.LayerNorm(8).to("meta")
    params = {tuple(p.shape) for p in (*linear.parameters(), *norm.parameters())}

    def launches(loop):
        recorder = gpu_model.Recorder(params)
        x = torch.empty(4, 8, device="meta")
        with gpu_model.cuda_code_path(recorder), recorder:
            with recorder.scope(region=loop, loop=loop):
                for _ in range(3):  # one weight used by three steps
                    x = norm(torch.tanh(linear(x)))
            x.sum().backward()
        adds = [k for k in recorder.kernels if k.kind == "accum"]
        by_size = {}
        for k in adds:
            by_size[k.numel] = by_size.get(k.numel, 0) + k.launches
        return by_size

    eager, loop = launches(False), launches(True)
    assert eager[64] == 2 and eager[8] >= 2          # W (8 x 8); the biases and LN (8,)
    assert loop[64] == 0 and 0 < loop[8] < eager[8]  # W's sums in its GEMMs; LN's one kernel


def test_bad_arch_is_a_clear_error():
    with pytest.raises(SystemExit, match="not a registered architecture"):
        gpu_model.main(["--arch", "sut_nonesuch"])


def test_flex_attention_is_one_kernel_per_self_attention():
    """``+flex``: each self-attention of a step is the FlexAttention kernel (1 launch
    forward, 2 backward) and the relative term's bias no longer materialises: fewer aten
    kernels than the same model's SDPA path."""
    sdpa = gpu_model.record_step("sut_tiny", False, 4, 8, 200)
    flex = gpu_model.record_step("sut_tiny+flex", False, 4, 8, 200)
    names = Counter(k.name for k in flex if k.kind == "attention")
    steps = 3 + 3  # sut_tiny: 3 encoder and 3 decoder steps, every position running
    assert names["flex_fwd"] == steps and names["flex_bwd"] == steps
    assert names["sdpa_fwd"] == 3 and names["sdpa_bwd"] == 3  # the decoder's cross-attention
    assert not any(k.name.startswith("flex") for k in sdpa)
    aten = [sum(k.launches for k in ks if k.kind == "aten") for ks in (sdpa, flex)]
    assert aten[1] < aten[0]


def test_inductor_sums_a_shared_weights_step_gradients_without_kernels_of_their_own(capsys):
    """The assumption behind the loop's accumulation (``benchmarks/inductor_accumulation.py``,
    compiled on the CPU): over 4 steps of one shared weight the backward has 4 dW GEMMs, 3
    of them adding into the running sum (``addmm``), 3 dx GEMMs, and one fused kernel per
    step (tanh's backward): no kernel that only sums gradients."""
    import inductor_accumulation

    inductor_accumulation.main(["--steps", "4"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "inductor accumulation: 4 steps, 7 gemms, 3 accumulating, 4 other kernels")


def test_factor_option_replaces_one_factor_and_refuses_bad_ones():
    base = gpu_model.Factors()
    new = gpu_model.replaced_factors(base, ["routed_wgrad=0.235", "floor_us=3"], pytest.fail)
    assert new == gpu_model.dataclasses.replace(base, routed_wgrad=0.235, floor_us=3.0)

    def error(message):
        raise ValueError(message)

    with pytest.raises(ValueError, match=r"--factor triton=0.2: 'triton' is not a factor \(one of floor_us, gemm"):
        gpu_model.replaced_factors(base, ["triton=0.2"], error)
    for bad in ("gemm=0", "gemm=-1", "gemm=fast", "gemm"):
        with pytest.raises(ValueError, match=f"--factor {bad}: the value must be a positive number"):
            gpu_model.replaced_factors(base, [bad], error)


def test_a_measured_kernel_time_gives_back_the_efficiency_that_prices_it():
    """fitted_efficiency on an exact example: two launches of 2^31 FLOPs each on a toy
    device of 100 TFLOP/s priced at 0.3 of the peak, found again from their time; launches
    at the floor even at the peak give 1.0."""
    dev = gpu_model.Device("toy", bf16_tflops=100.0, hbm_tbs=1.0)
    f = gpu_model.Factors(floor_us=5.0, bandwidth=0.5)
    routed = [gpu_model.Kernel("triton", "_routed_gemm", 2, 2 * 2.0 * 1024 ** 3, 1e6),
              gpu_model.Kernel("triton", "_routed_wgrad", 1, 2.0 * 1024 ** 3, 1e6)]
    measured = 1e3 * 2 * 2.0 * 1024 ** 3 / (0.3 * 100e12)
    assert gpu_model.fitted_efficiency(routed, "_routed_gemm", measured, dev, f) == pytest.approx(0.3, rel=1e-6)
    assert gpu_model.fitted_efficiency(routed, "_routed_wgrad", 1e3 * 2.0 * 1024 ** 3 / (0.05 * 100e12),
                                       dev, f) == pytest.approx(0.05, rel=1e-6)
    tiny = [gpu_model.Kernel("triton", "_routed_gemm", 3, 1e3, 1e3)]
    assert gpu_model.fitted_efficiency(tiny, "_routed_gemm", 3 * 5e-3, dev, f) == 1.0


def test_train_steps_plugin_kernels_line_is_what_the_model_reads(tmp_path):
    """train_step.py --profile's line of the plugin's Triton kernels (device events whose
    names begin with '_'; not inductor's, the libraries', nor host events) parses back to
    {profile key: {kernel: (launches, ms)}}, a key's last line kept."""
    from types import SimpleNamespace

    import train_step
    from torch.autograd import DeviceType

    def event(key, count, us, device=DeviceType.CUDA):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us, device_type=device)

    events = [event("_routed_wgrad", 60, 4330.0), event("_routed_gemm", 120, 3134.0),
              event("triton_poi_fused_add_0", 40, 900.0), event("sm90_xmma_gemm", 200, 1700.0),
              event("_routed_gemm", 120, 50.0, DeviceType.CPU)]
    line = train_step.plugin_kernels_line("compiled sut_base", events)
    assert line == "== plugin kernels compiled sut_base: _routed_gemm 120 3.134; _routed_wgrad 60 4.330"
    log = tmp_path / "bench.log"
    log.write_text("+ python benchmarks/train_step.py ...\n"
                   "== plugin kernels sut_base: _routed_gemm 120 9.000\n"
                   f"{line}\n== plugin kernels sut_base: _routed_gemm 120 5.000; _ce_forward 1 0.140\n")
    assert gpu_model.plugin_kernels_in(str(log)) == {
        "sut_base": {"_routed_gemm": (120, 5.0), "_ce_forward": (1, 0.14)},
        "compiled sut_base": {"_routed_gemm": (120, 3.134), "_routed_wgrad": (60, 4.33)}}
    profiles = gpu_model.plugin_kernels_in(str(log))
    assert gpu_model.profile_for(profiles, "sut_base", "step") == "compiled sut_base"
    assert gpu_model.profile_for(profiles, "sut_base", "eager") == "sut_base"
    assert gpu_model.profile_for(profiles, "sut_base", "loop") == "compiled sut_base"   # same launches
    assert gpu_model.profile_for(profiles, "ut_base", "eager") is None


def test_measured_kernels_refit_the_routed_factors_of_the_predicted_step(tmp_path, capsys):
    """--measured-kernels: the step's _routed_gemm launches are priced at their measured
    time (the by-kind row reads it), a kernel whose launches differ from the modelled
    step's keeps its factor; a missing log is refused."""
    kernels = gpu_model.record_step("sut_tiny", False, 4, 8, 200)
    n_gemm = sum(k.launches for k in kernels if k.name == "_routed_gemm")
    n_wgrad = sum(k.launches for k in kernels if k.name == "_routed_wgrad")
    # three times the time the calibrated factor gives them (sut_tiny's launches sit at the
    # floor: a far lower efficiency prices them so)
    now = sum(gpu_model.kernel_ms(k, gpu_model.H200) for k in kernels if k.name == "_routed_gemm")
    log = tmp_path / "bench.log"
    # (a compiled graph may number a kernel: _routed_gemm and _routed_gemm_0 are one)
    log.write_text(f"== plugin kernels sut_tiny: _routed_gemm {n_gemm - 1} {2 * now:.3f}; "
                   f"_routed_gemm_0 1 {now:.3f}; _routed_gemm_rows 7 9.000; "
                   f"_routed_wgrad {n_wgrad + 1} 1.000\n")
    factors = gpu_model.FACTORS
    try:
        gpu_model.main(["--arch", "sut_tiny", "--batch", "4", "--len", "8", "--vocab", "200",
                        "--measured-kernels", str(log)])
    finally:
        gpu_model.FACTORS = factors
    out = capsys.readouterr().out
    m = re.search(rf"^gpu model: refit routed_gemm ([\d.e-]+) \(was 0.235\) from _routed_gemm {n_gemm} "
                  rf"launches {round(2 * now, 3) + round(now, 3):.3f} ms \(profile 'sut_tiny'\)$", out, re.M)
    assert m and float(m[1]) < 0.235, out
    assert f"gpu model: measured _routed_wgrad: {n_wgrad + 1} launches in the profile 'sut_tiny' " \
           f"against {n_wgrad} in the modelled step: routed_wgrad not refit" in out
    row = re.search(rf"^  triton _routed_gemm +{n_gemm} +([\d.]+)$", out, re.M)
    assert row and float(row[1]) == pytest.approx(3 * now, abs=0.006), out
    with pytest.raises(SystemExit):
        gpu_model.main(["--arch", "sut_tiny", "--measured-kernels", str(tmp_path / "none.log")])
    assert "--measured-kernels" in capsys.readouterr().err
