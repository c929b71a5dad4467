"""One full training step (forward + backward through the criterion) on CPU, every model
on the same batch. Two presets:

``--preset wmt`` (default): ``sut_base``, ``ut_base`` and fairseq's ``transformer_wmt_en_de``.

The batch: B sentences of T source and T target tokens (default 128 x 32 = 4,096 target
tokens) over a 32,768-entry joined dictionary with shared embeddings; criterion
``sut_label_smoothed_cross_entropy`` (label smoothing 0.1, MIM 0.1, ACT 0.01) for the
SUT/UT and ``label_smoothed_cross_entropy`` for the transformer; dropout as in each
preset. Prints the median time per step and target tokens/s of each model, then the
ratios (goals: sut_base >= 2.0x ut_base, sut_base >= 0.6x transformer). All three models
are built first; in each of ``--repeats`` rounds every model runs an untimed step and then
a timed one, the models taking turns, so that a slow phase of a shared machine hits all
of them alike while each timed step runs in its model's steady state.

    python benchmarks/train_step.py [--batch 128] [--len 32] [--repeats 3] [--arch ...]
        [--device cuda --bf16]    # on a GPU: the Triton expert kernels, peak memory per model
        [--profile 25]            # then one profiled step per model: where the time goes

``--profile N`` runs, after the timing, one more step of each model under
``torch.profiler`` and prints its wall time, the number of kernel launches and of aten
operator calls (nested ones included), how long the
device was busy (the sum of the device's own events: kernels, memsets, copies; a step whose
device is busy for a small part of its wall time is bound by the host, i.e. by launches
and Python), the CUDA-graph launches where graphs are replayed (``+graphs``) and the N operations with the most self time on the device (on a CPU: on the
host); on a GPU then, from one more profiled step, the N operators with the most device
time grouped by their input shapes (which product a slow kernel serves). With
``--compile`` the compiled models are profiled the same way after the eager ones
(``== profile compiled ARCH: ...``).

``--arch ... transformer_wmt_en_de+fused-ce`` adds fairseq's transformer trained with the
plugin's label-smoothed CE op (``sut_fairseq.ops.label_smoothed_ce``, which the SUT/UT
criterion uses), to separate the loss's share from the model's.

``--preset logic``: ``sut_logic`` against the transformer of ``configs/logic/transformer.json``
(fairseq's ``transformer``, d 128, 4 heads, FFN 256, 6+6 layers), both pre-LN as the logic
recipe trains them, with the recipe's losses (SUT: MIM 0.01, ACT 0), on one batch of
logical-inference pairs with 0-6 operators (about ``--logic-tokens`` source tokens, the
recipe's ``--max-tokens``; generated, no data files needed). The SUT's halting units are
set so that positions halt at different steps, about 8 of the 12 encoder steps on average
(``--halting-bias``; the mean is printed): the same forcing before and after any change.
Runs at each of ``--threads`` and prints ``sut_logic / transformer tokens/s: R`` per
thread count, beside the ratio the SUT would reach at the transformer's MACs per second
(transformer MACs / sut_logic MACs of one forward on the batch, the SUT counted
dynamically by ``sut_fairseq.analysis.macs``) and R divided by it, the SUT's MAC throughput
relative to the transformer's. The same bound is printed for the SUT with every encoder step
run, the regime of the recipe's training (its halting units start at â = 0.047 and it runs
11.9-12 of 12 encoder steps): the most R can be there at equal MAC throughput.

    python benchmarks/train_step.py --preset logic [--threads 1 2] [--repeats 5] [--bf16]

``--arch`` of the logic preset also takes the recipe's dense models: ``ut_logic`` (UT with
halting, ``configs/logic/ut-halting.json``), ``gut_logic``, ``tlb_logic`` and ``gutlb_logic``
(``gut.json``, ``tlb.json``, ``gutlb.json``: the recurrent-transformers paper's models as the
seq2seq recipe trains them, their own halting initialisation), each printed with its ms/step
and, where it halts, its mean executed encoder steps:

    python benchmarks/train_step.py --preset logic --threads 1 --arch ut_logic gut_logic tlb_logic gutlb_logic

(``--bf16``: both models with parameters and activations in bfloat16, as fairseq's --bf16.)

``--compile`` (wmt, logic): after the eager figures, every model again compiled, the
plugin's with ``--compile-step`` (each side's recurrence step one ``torch.compile`` graph,
``docs/performance.md``) and fairseq's transformer through ``torch.compile``: the seconds
of each model's first step (compiling), its steady ms/step, compiled / eager per model,
``compiled: sut_logic / transformer tokens/s: R`` and, for the logic SUT, ``graph breaks
in the SUT step: N`` (``torch._dynamo.explain`` over every step of one forward).

    python benchmarks/train_step.py --preset logic --compile --threads 1

Suffixes of ``--arch`` (wmt) choose how a model compiles; eager, a suffixed model is the
model itself: ``+loop`` a SUT/UT with ``--compile-loop`` (all L steps of a side one
graph); ``+graphs`` in ``torch.compile``'s mode ``reduce-overhead``, whose graphs a GPU
replays as CUDA graphs (a SUT/UT over its compiled loop, ``sut_base+loop+graphs``;
fairseq's transformer whole, ``transformer_wmt_en_de+graphs``; the run prints how many
compiled graphs inductor did not replay as CUDA graphs, and logs why). Every compiled SUT
is compared with every compiled transformer and with the eager transformer (what
``fairseq-train`` runs; the issue's goal 0.6):

    python benchmarks/train_step.py --device cuda --bf16 --profile 25 --compile \
        --arch sut_base+loop+graphs transformer_wmt_en_de+graphs

``--preset cpvr``: the three models of the C-PVR recipe (``configs/cpvr``: ``ut_cpvr`` the
dense UT, ``sut_cpvr`` the SUT of the same active size, ``hyper_ut_cpvr`` Hyper-UT), pre-LN
with shared embeddings and the recipe's losses (no label smoothing, ACT 0.01), on one batch
of C-PVR sequences of the recipe's ``small`` data (modulus, L 16, K 100, hops 1-4 in turn;
about ``--logic-tokens`` source tokens; generated, no data files needed). Every model's
halting units get the same forcing (``--halting-bias``; the mean executed encoder steps
are printed). Prints ``hyper_ut_cpvr / ut_cpvr tokens/s`` and ``sut_cpvr / ut_cpvr``
per thread count.

    python benchmarks/train_step.py --preset cpvr [--threads 1] [--repeats 5]
"""
import argparse
import logging
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

logging.disable(logging.WARNING)

from fairseq.criterions.label_smoothed_cross_entropy import (  # noqa: E402
    LabelSmoothedCrossEntropyCriterion,
)

from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import (  # noqa: E402
    SUTLabelSmoothedCrossEntropyCriterion,
)
from sut_fairseq.ops.label_smoothed_ce import label_smoothed_cross_entropy  # noqa: E402
from sut_fairseq.models.standalone import build_model  # noqa: E402

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, os.path.join(_SCRIPTS, "logic"))
sys.path.insert(0, os.path.join(_SCRIPTS, "cpvr"))
import cpvr_recipe  # noqa: E402
import logic_recipe  # noqa: E402

MODELS = ["sut_base", "ut_base", "transformer_wmt_en_de"]
LOGIC_MODELS = ["sut_logic", "transformer"]
#: the logic recipe's dense recurrent models, timed on request (--arch)
LOGIC_DENSE_MODELS = ["ut_logic", "gut_logic", "tlb_logic", "gutlb_logic"]
CPVR_MODELS = ["ut_cpvr", "sut_cpvr", "hyper_ut_cpvr"]
#: benchmark arch -> (the recipe's model grid, its model: configs/TASK/MODEL.json over common.json)
RECIPE_MODELS = {"sut_logic": (logic_recipe.GRID, "sut"),
                 "transformer": (logic_recipe.GRID, "transformer"),
                 "ut_logic": (logic_recipe.GRID, "ut-halting"),
                 "gut_logic": (logic_recipe.GRID, "gut"),
                 "tlb_logic": (logic_recipe.GRID, "tlb"),
                 "gutlb_logic": (logic_recipe.GRID, "gutlb"),
                 "ut_cpvr": (cpvr_recipe.GRID, "ut"),
                 "sut_cpvr": (cpvr_recipe.GRID, "sut"),
                 "hyper_ut_cpvr": (cpvr_recipe.GRID, "hyper-ut")}
#: benchmark archs whose halting units ``--halting-bias`` forces
FORCED_HALTING = {"sut_logic", *CPVR_MODELS}
FUSED_CE = "+fused-ce"  # suffix: fairseq's transformer with the plugin's CE op as its loss
#: suffix: a SUT/UT whose compiled form runs all steps of a side as one graph
#: (--compile-loop) rather than one graph per step; eager it is the model without suffix
LOOP = "+loop"
#: suffix: compiled with torch.compile's mode "reduce-overhead", whose graphs a GPU replays
#: as CUDA graphs (one launch for a graph's kernels, no per-kernel host work): fairseq's
#: transformer whole, a SUT/UT over its compiled loop (with +loop: one graph invocation per
#: side and forward); eager it is the model without suffix
GRAPHS = "+graphs"
#: suffix: a SUT/UT with --flex-attention (its self-attention one FlexAttention kernel on
#: CUDA) and --attention-dropout 0, which the option needs; on a CPU the usual attention
FLEX = "+flex"


def split_arch(arch: str):
    """``"sut_base+loop+graphs"`` -> ``("sut_base", {"+loop", "+graphs"})``; an unknown
    suffix, or ``+graphs`` on a SUT/UT without ``+loop``, is an error naming it."""
    name, *rest = arch.split("+")
    suffixes = {"+" + s for s in rest}
    unknown = sorted(suffixes - {FUSED_CE, LOOP, GRAPHS, FLEX})
    if unknown:
        raise SystemExit(f"train_step.py: {arch}: unknown suffix {unknown[0]!r} "
                         f"(known: {FUSED_CE}, {LOOP}, {GRAPHS}, {FLEX})")
    if FLEX in suffixes and not is_recurrent(name):
        raise SystemExit(f"train_step.py: {arch}: {FLEX} is an option of the plugin's models")
    if GRAPHS in suffixes and is_recurrent(name) and LOOP not in suffixes:
        raise SystemExit(f"train_step.py: {arch}: {GRAPHS} on a SUT/UT needs {LOOP} (CUDA graphs "
                         f"over the compiled loop: {name}{LOOP}{GRAPHS})")
    return name, suffixes


class FusedLabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyCriterion):
    """fairseq's criterion with the loss computed by ``ops.label_smoothed_ce``."""

    def compute_loss(self, model, net_output, sample, reduce=True):
        logits, target = net_output[0], model.get_targets(sample, net_output)
        return label_smoothed_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                            self.eps, self.padding_idx)


def make_batch(B: int, T: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, T), generator=g)
    tgt = torch.randint(4, vocab, (B, T), generator=g)
    tgt[:, -1] = 2
    prev = torch.cat([torch.full((B, 1), 2), tgt[:, :-1]], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((B,), T),
                          "prev_output_tokens": prev},
            "target": tgt, "ntokens": B * T, "nsentences": B}


def make_logic_batch(source_tokens: int, seed: int):
    """Logical-inference pairs with 0-6 operators as fairseq batches them: left-padded
    sources of about ``source_tokens`` tokens in all, target = relation + </s>. Returns
    the sample and the vocabulary size (a dictionary of the pairs' symbols)."""
    from fairseq.data import Dictionary

    from sut_fairseq.data.logic_inference import iter_pairs, to_seq2seq

    pairs = []
    for bucket, pair in iter_pairs(seed):
        if bucket <= 6:
            src, tgt = to_seq2seq(pair)
            pairs.append((src.split() + ["</s>"], tgt))
            if len(pairs) == 4000:
                break
    # fairseq batches pairs of similar length: B * longest <= --max-tokens; take the
    # batch at the training set's mean source length (28 tokens with </s>)
    pairs.sort(key=lambda p: len(p[0]))
    start = next(i for i, p in enumerate(pairs) if len(p[0]) >= 28)
    end = start + 1
    while end < len(pairs) and (end + 1 - start) * len(pairs[end][0]) <= source_tokens:
        end += 1
    pairs = pairs[start:end]
    total = sum(len(src) for src, _ in pairs)
    d = Dictionary()
    for src, tgt in pairs:
        for w in src[:-1] + [tgt]:
            d.add_symbol(w)
    S = max(len(src) for src, _ in pairs)
    B = len(pairs)
    src_tokens = torch.full((B, S), d.pad())
    for i, (src, _) in enumerate(pairs):
        src_tokens[i, S - len(src):] = torch.tensor([d.index(w) for w in src])
    rel = torch.tensor([d.index(t) for _, t in pairs])
    target = torch.stack([rel, torch.full((B,), d.eos())], 1)
    prev = torch.stack([torch.full((B,), d.eos()), rel], 1)
    sample = {"net_input": {"src_tokens": src_tokens,
                            "src_lengths": torch.tensor([len(s) for s, _ in pairs]),
                            "prev_output_tokens": prev},
              "target": target, "ntokens": 2 * B, "nsentences": B}
    return sample, len(d), total


def make_cpvr_batch(source_tokens: int, seed: int):
    """C-PVR sequences of the recipe's ``small`` data (modulus, L 16, K 100), hops 1-4 in
    turn, as fairseq batches them: sources of L numbers + </s>, target = label + </s>,
    ``source_tokens // (L + 1)`` sequences. Returns the sample, the vocabulary size and
    the source tokens."""
    from fairseq.data import Dictionary

    from sut_fairseq.data.cpvr import HopSampler, iter_split, make_config, to_seq2seq

    config = make_config("small")
    sampler = HopSampler(config.length, config.max_value)
    B = max(1, source_tokens // (config.length + 1))
    examples = iter_split(sampler, "benchmark", config.train_hops,
                          -(-B // len(config.train_hops)), seed, set())
    pairs = [to_seq2seq(e) for _, e in zip(range(B), examples)]
    d = Dictionary()
    for value in range(1, config.max_value + 1):
        d.add_symbol(str(value))
    src_tokens = torch.tensor([[d.index(w) for w in src.split()] + [d.eos()] for src, _ in pairs])
    label = torch.tensor([d.index(tgt) for _, tgt in pairs])
    sample = {"net_input": {"src_tokens": src_tokens,
                            "src_lengths": torch.full((B,), src_tokens.size(1)),
                            "prev_output_tokens": torch.stack([torch.full((B,), d.eos()), label], 1)},
              "target": torch.stack([label, torch.full((B,), d.eos())], 1),
              "ntokens": 2 * B, "nsentences": B}
    return sample, len(d), src_tokens.numel()


def _option_values(flags):
    """fairseq options -> keyword arguments: ``["--a-b", "1", "--c"]`` -> {a_b: 1, c: True}."""
    def value(text):
        for cast in (int, float):
            try:
                return cast(text)
            except ValueError:
                pass
        return text

    return {opt[2:].replace("-", "_"): value(vals[0]) if vals else True
            for opt, vals in logic_recipe.parse_flags(flags).items()}


def recipe_model(arch: str):
    """(fairseq arch, build_model keyword arguments, criterion options) of a benchmark
    arch of ``RECIPE_MODELS``, read from its recipe's configs: the architecture options
    with common.json's pre-LN and shared embeddings, and the loss options (e.g. MIM 0.01,
    ACT 0 for the logic SUT) with common.json's label smoothing."""
    grid, model = RECIPE_MODELS[arch]
    kwargs = _option_values(grid.model_arch_flags(model))
    recipe_arch = kwargs.pop("arch")
    loss = _option_values(grid.model(model)["loss_flags"])
    loss.setdefault("label_smoothing", _option_values(grid.common()["flags"]).get("label_smoothing", 0.0))
    return recipe_arch, kwargs, loss


def encoder_depth(arch: str) -> int:
    """Encoder steps (``--encoder-layers``) of a ``RECIPE_MODELS`` arch: its recipe's flag,
    else its fairseq architecture's default."""
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY

    recipe_arch, kwargs, _ = recipe_model(arch)
    args = Namespace(**kwargs)
    ARCH_CONFIG_REGISTRY[recipe_arch](args)
    return args.encoder_layers


def force_halting(model, bias: float, seed: int = 0) -> None:
    """Halting units with random last layers (std 1 logits) and the given bias: positions
    halt at different, token-dependent steps."""
    g = torch.Generator().manual_seed(seed)
    for side in (model.encoder.side, model.decoder.side):
        unit = side.halting.unit
        with torch.no_grad():
            unit.fc2.weight.copy_(torch.randn(unit.fc2.weight.shape, generator=g)
                                  / unit.fc2.weight.size(1) ** 0.5)
            unit.fc2.bias.fill_(bias)


def cudagraph_skips() -> int:
    """How many compiled graphs inductor declined to replay as CUDA graphs in this process
    (every graph on a CPU; on a GPU e.g. one that mutates an input or syncs the host)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def is_recurrent(arch: str) -> bool:
    """Whether ``arch`` is one of the plugin's models (SUT, UT, Hyper-UT, GUT, TLB, GUTLB)."""
    return arch.startswith(("sut", "ut", "hyper_ut", "gut", "tlb"))


def build(arch: str, vocab: int, halting_bias: float, compiled: bool = False):
    """The model and its criterion for one benchmark entry; ``compiled``: the plugin's
    models with ``--compile-step``, fairseq's transformer through ``torch.compile``."""
    torch.manual_seed(0)
    name, suffixes = split_arch(arch)
    fused, loop, graphs = FUSED_CE in suffixes, LOOP in suffixes, GRAPHS in suffixes
    mode = "reduce-overhead" if graphs else None
    loss = None
    extra = {"compile_loop" if loop else "compile_step": True} if compiled and is_recurrent(arch) else {}
    if FLEX in suffixes:
        extra.update(flex_attention=True, attention_dropout=0.0)
    if name in RECIPE_MODELS:
        recipe_arch, kwargs, loss = recipe_model(name)
        model = build_model(recipe_arch, dict_size=vocab, **{**kwargs, **extra})
        if name in FORCED_HALTING:
            force_halting(model, halting_bias)
    else:
        model = build_model(name, dict_size=vocab, share_all_embeddings=True, **extra)
    model.train()
    if compiled and graphs:  # why a graph is not replayed as a CUDA graph, in the log
        torch._logging.set_logs(cudagraphs=True)
    if compiled and not is_recurrent(arch):
        model = torch.compile(model, mode=mode)  # the criterion reaches the model's methods through it
    elif compiled:
        for side in (model.encoder.side, model.decoder.side):
            if side.compiled_step is not None:
                side.compiled_step.mode = mode
    task = SimpleNamespace(target_dictionary=model.decoder.dictionary)
    if loss is not None and loss["criterion"] == "sut_label_smoothed_cross_entropy":  # the recipe's losses
        criterion = SUTLabelSmoothedCrossEntropyCriterion(
            task, False, loss["label_smoothing"], mim_weight=loss["mim_weight"],
            act_weight=loss["act_weight"])
    elif arch.startswith(("sut", "ut")):
        criterion = SUTLabelSmoothedCrossEntropyCriterion(task, False, 0.1, mim_weight=0.1, act_weight=0.01)
    elif fused:
        criterion = FusedLabelSmoothedCrossEntropy(task, False, 0.1)
    else:
        criterion = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    return model, criterion


def to_device(sample, device: torch.device):
    """The batch with every tensor on ``device``."""
    return {k: to_device(v, device) if isinstance(v, dict) else
            (v.to(device) if torch.is_tensor(v) else v) for k, v in sample.items()}


def make_step(arch: str, sample, vocab: int, halting_bias: float = 0.0, steps_log=None,
              device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32,
              compiled: bool = False):
    """A closure running one training step (zero grads, criterion forward, backward);
    appends the mean executed encoder steps to ``steps_log`` (SUT/UT) when given. On a GPU
    the model and batch go to ``device`` (parameters in ``dtype``, as fairseq's --bf16).
    ``compiled``: the model compiled (``build``)."""
    model, criterion = build(arch, vocab, halting_bias, compiled)
    model.to(device=device, dtype=dtype)
    return step_closure(model, criterion, to_device(sample, device), steps_log)


def step_closure(model, criterion, sample, steps_log=None):
    """The training step of ``make_step`` for a model, criterion and batch already in place
    (``benchmarks/gpu_model.py`` runs it on "meta" tensors)."""

    def step():
        model.zero_grad(set_to_none=True)
        loss, _, log = criterion(model, sample)
        loss.backward()
        if steps_log is not None and "steps_enc" in log:
            steps_log.append(log["steps_enc"] / log["positions_enc"])

    return step


def time_steps(archs, sample, vocab: int, repeats: int, halting_bias: float = 0.0, steps_log=None,
               device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32,
               peak_memory=None, steps=None, compiled: bool = False, first_step=None):
    """Median seconds per step of each arch over ``repeats`` rounds. In every round each
    arch runs one untimed step (back in its steady state: caches and allocator warm with
    its own buffers, as in training) and then one timed step; the archs take turns within
    a round, so that a slow phase of a shared machine hits all of them alike. On a GPU,
    ``peak_memory[arch]`` receives the largest allocated memory of a timed step (bytes).
    ``steps[arch]``, when a dict is given, receives each arch's (warm) step closure.
    ``compiled``: the models compiled (``build``); ``first_step[arch]``, when a dict is
    given, receives the seconds of each arch's first step (with compilation, its cost)."""
    steps = {} if steps is None else steps
    cuda = device.type == "cuda"
    for arch in archs:  # steps_log: one list for every SUT/UT, or a dict of one list per arch
        log = (steps_log.setdefault(arch, []) if isinstance(steps_log, dict) else
               steps_log if arch.startswith(("sut", "ut")) else None)
        steps[arch] = make_step(arch, sample, vocab, halting_bias, log, device, dtype, compiled)
        if first_step is not None:
            start = time.perf_counter()
            steps[arch]()
            if cuda:
                torch.cuda.synchronize()
            first_step[arch] = time.perf_counter() - start
    times = {arch: [] for arch in archs}
    for _ in range(repeats):
        for arch, step in steps.items():
            step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
                if peak_memory is not None:
                    peak_memory[arch] = max(peak_memory.get(arch, 0), torch.cuda.max_memory_allocated())
            times[arch].append(time.perf_counter() - start)
    return {arch: statistics.median(t) for arch, t in times.items()}


def profiled(step, cuda: bool = False, shapes: bool = False):
    """(the profiler's per-operator averages, wall ms) of one call of ``step`` under
    ``torch.profiler``; on a GPU with the CUDA activity too, synchronised on both sides.
    ``shapes``: the averages grouped by operator and input shapes as well."""
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start)
    return prof.key_averages(group_by_input_shape=shapes), wall_ms


def device_ms(events) -> float:
    """Milliseconds the device spent in the profiled events' kernels, memsets and copies.

    Only the device's own events count: a host-side operator carries the time of the
    kernels it launched as its ``self_device_time_total`` too, so summing every event
    counts each kernel twice (what this benchmark printed until stop 47, and torch's own
    table footer, "Self CUDA time total", avoids the same way)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)) / 1e3


def plugin_kernels_line(arch: str, events) -> str:
    """``== plugin kernels ARCH: NAME LAUNCHES MS; ...``: the device time of the plugin's
    Triton kernels (their names begin with ``_``: ``_routed_gemm``, ``_routed_wgrad``,
    ``_route_rows``, ``_ce_forward`` ...; inductor's begin with ``triton_``, the libraries'
    with their own), for ``benchmarks/gpu_model.py --measured-kernels``."""
    from torch.autograd import DeviceType

    ours = sorted((e.key, e.count, e.self_device_time_total / 1e3) for e in events
                  if e.device_type != DeviceType.CPU and e.key.startswith("_"))
    return f"== plugin kernels {arch}: " + "; ".join(f"{k} {n} {ms:.3f}" for k, n, ms in ours)


def print_profile(arch: str, step, rows: int, cuda: bool) -> None:
    """Profile one call of ``arch``'s (warm) ``step``; print its wall time, kernel launches,
    aten calls, device busy time (GPU) and its ``rows`` most expensive operations; on a
    GPU, from a second profiled call, the operators with the most device time by input
    shapes (which product a slow kernel serves)."""
    events, wall_ms = profiled(step, cuda)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
    ops = sum(e.count for e in events if e.key.startswith("aten::"))   # nested calls included
    busy = ""
    if cuda:
        busy_ms = device_ms(events)
        busy = f", device busy {busy_ms:.1f} ms ({100 * busy_ms / wall_ms:.0f}%)"
        graphs = sum(e.count for e in events if e.key.startswith("cudaGraphLaunch"))
        if graphs:  # CUDA graphs: one host call replays a graph's kernels
            busy += f", {graphs} CUDA-graph launches"
    print(f"== profile {arch}: {wall_ms:.1f} ms wall under the profiler, {launches} kernel launches, "
          f"{ops} aten operator calls{busy}")
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=rows),
          flush=True)
    if cuda:
        print(plugin_kernels_line(arch, events), flush=True)
        by_shape, _ = profiled(step, cuda, shapes=True)
        print(f"== device time of {arch} by operator and input shapes")
        print(by_shape.table(sort_by="device_time_total", row_limit=rows, max_name_column_width=40,
                             max_shapes_column_width=90), flush=True)


#: halting bias at which no position halts (â = sigmoid(-30)): every encoder step runs, as
#: in the recipe's training, whose halting units start at â = 0.047 and run 11.9-12 of 12
FULL_DEPTH_BIAS = -30.0


def logic_macs(sample, vocab: int, halting_bias: float) -> dict:
    """MACs of one forward on ``sample`` per model, the SUT counted dynamically (only the
    (position, step) pairs that ran under the halting forcing)."""
    from sut_fairseq.analysis.macs import count_forward

    macs = {}
    for arch in LOGIC_MODELS:
        model, _ = build(arch, vocab, halting_bias)
        mode = "dynamic" if arch == "sut_logic" else "static"
        macs[arch] = count_forward(model, sample["net_input"], mode=mode).total
    return macs


def logic_mac_ratio(sample, vocab: int, halting_bias: float) -> float:
    """transformer MACs / sut_logic MACs of one forward on ``sample``: the tokens/s ratio
    the SUT would reach at the transformer's MACs per second, under the benchmark's halting
    forcing; also printed for the SUT with every encoder step run (the training regime)."""
    macs = logic_macs(sample, vocab, halting_bias)
    print(f"MACs of one forward on this batch: sut_logic {macs['sut_logic'] / 1e9:.2f} G "
          f"(dynamic), transformer {macs['transformer'] / 1e9:.2f} G")
    full = logic_macs(sample, vocab, FULL_DEPTH_BIAS)["sut_logic"]
    print(f"with all 12 encoder steps run (as in training): sut_logic {full / 1e9:.2f} G, "
          f"R at the transformer's MACs/s: {macs['transformer'] / full:.2f}")
    return macs["transformer"] / macs["sut_logic"]


def sut_graph_breaks(arch: str, sample, vocab: int, halting_bias: float) -> int:
    """Graph breaks ``torch._dynamo.explain`` finds in the compiled steps of ``arch`` (built
    with ``--compile-step``) over one training forward on ``sample``."""
    from sut_fairseq.compiler import count_graph_breaks

    model, _ = build(arch, vocab, halting_bias, compiled=True)
    return count_graph_breaks(model, sample["net_input"])


def print_compiled(archs, sample, vocab: int, args, tokens: int, threads: int, name: str,
                   device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32, steps=None) -> dict:
    """Time the archs compiled (``--compile``); print each one's first step (compiling)
    and steady step, and return tokens/s per arch. ``steps``, when a dict is given,
    receives each arch's (warm) compiled step closure."""
    tag = f"[{threads} thread{'s' if threads > 1 else ''}]"
    first, speed = {}, {}
    for arch, t in time_steps(archs, sample, vocab, args.repeats, args.halting_bias,
                              device=device, dtype=dtype, compiled=True, first_step=first,
                              steps=steps).items():
        speed[arch] = tokens / t
        print(f"{tag} compiled {arch:12s} {1e3 * t:8.1f} ms/step {speed[arch]:9.0f} {name} tokens/s "
              f"(first step, compiling: {first[arch]:.1f} s)", flush=True)
    return speed


def compile_archs(args, archs) -> list:
    """The models ``--compile`` names (all of ``archs`` when it names none); each must be
    one of the timed ``archs``."""
    named = args.compile or list(archs)
    unknown = [a for a in named if a not in archs]
    if unknown:
        raise SystemExit(f"train_step.py: --compile {unknown[0]}: not among the timed models "
                         f"({' '.join(archs)})")
    return named


def main_logic(args):
    sample, vocab, src_tokens = make_logic_batch(args.logic_tokens, args.seed)
    tokens = sample["ntokens"]
    archs = args.arch or LOGIC_MODELS
    if args.compile is not None:
        compile_archs(args, archs)
    print(f"torch {torch.__version__}; logic batch: {sample['nsentences']} pairs, {src_tokens} "
          f"source tokens (padded {tuple(sample['net_input']['src_tokens'].shape)}), "
          f"{tokens} target tokens; vocabulary {vocab}; {'bf16' if args.bf16 else 'fp32'}")
    both = {"sut_logic", "transformer"} <= set(archs)
    mac_ratio = logic_mac_ratio(sample, vocab, args.halting_bias) if both else None
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for threads in args.threads:
        torch.set_num_threads(threads)
        steps_log = {}
        speed = {}
        for arch, t in time_steps(archs, sample, vocab, args.repeats, args.halting_bias,
                                  steps_log, dtype=dtype).items():
            speed[arch] = src_tokens / t
            print(f"[{threads} thread{'s' if threads > 1 else ''}] {arch:12s} {1e3 * t:8.1f} ms/step "
                  f"{speed[arch]:9.0f} source tokens/s", flush=True)
        for arch, log in steps_log.items():
            if log:
                print(f"[{threads} thread{'s' if threads > 1 else ''}] {arch} mean executed encoder "
                      f"steps: {statistics.mean(log):.2f} of {encoder_depth(arch)}")
        if {"sut_logic", "transformer"} <= speed.keys():
            ratio = speed["sut_logic"] / speed["transformer"]
            print(f"[{threads} thread{'s' if threads > 1 else ''}] sut_logic / transformer tokens/s: "
                  f"{ratio:.2f} (goal >= 0.4; at the transformer's MACs/s: {mac_ratio:.2f}; "
                  f"sut_logic's MACs/s = {ratio / mac_ratio:.2f}x the transformer's)")
        if args.compile is not None:
            compiled = print_compiled(compile_archs(args, archs), sample, vocab, args, src_tokens,
                                      threads, "source", dtype=dtype)
            for sut in ("sut_logic", "sut_logic" + LOOP):
                if {sut, "transformer"} <= compiled.keys():
                    print(f"compiled: {sut} / transformer tokens/s: "
                          f"{compiled[sut] / compiled['transformer']:.2f} (goal >= 0.33)")
                    if "transformer" in speed:  # against the transformer's faster form
                        best = max(speed["transformer"], compiled["transformer"])
                        form = "eager" if best == speed["transformer"] else "compiled"
                        print(f"compiled {sut} / the faster transformer ({form}) tokens/s: "
                              f"{compiled[sut] / best:.2f}")
            for arch in archs:
                if arch in speed and arch in compiled:
                    print(f"[{threads} thread{'s' if threads > 1 else ''}] {arch} compiled / eager "
                          f"tokens/s: {compiled[arch] / speed[arch]:.2f}")
    if args.compile is not None and "sut_logic" in compile_archs(args, archs):
        print(f"graph breaks in the SUT step: "
              f"{sut_graph_breaks('sut_logic', sample, vocab, args.halting_bias)}")


def main_cpvr(args):
    sample, vocab, src_tokens = make_cpvr_batch(args.logic_tokens, args.seed)
    archs = args.arch or CPVR_MODELS
    print(f"torch {torch.__version__}; C-PVR batch: {sample['nsentences']} sequences, {src_tokens} "
          f"source tokens, {sample['ntokens']} target tokens; vocabulary {vocab}; halting bias "
          f"{args.halting_bias}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        tag = f"[{threads} thread{'s' if threads > 1 else ''}]"
        steps_log, speed = {}, {}
        for arch, t in time_steps(archs, sample, vocab, args.repeats, args.halting_bias,
                                  steps_log).items():
            speed[arch] = src_tokens / t
            depth = (f", {statistics.mean(steps_log[arch]):.2f} encoder steps of 16"
                     if steps_log.get(arch) else "")
            print(f"{tag} {arch:14s} {1e3 * t:8.1f} ms/step {speed[arch]:9.0f} source tokens/s{depth}",
                  flush=True)
        for arch in ("hyper_ut_cpvr", "sut_cpvr"):
            if {arch, "ut_cpvr"} <= speed.keys():
                print(f"{tag} {arch} / ut_cpvr tokens/s: {speed[arch] / speed['ut_cpvr']:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["wmt", "logic", "cpvr"], default="wmt")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", nargs="*", default=None,
                        help=f"models (wmt: {' '.join(MODELS)}; logic: {' '.join(LOGIC_MODELS)}, or "
                             f"{' '.join(LOGIC_DENSE_MODELS)}; "
                             f"cpvr: {' '.join(CPVR_MODELS)}); a SUT/UT with the suffix {LOOP} "
                             f"is compiled with --compile-loop (all steps one graph); with "
                             f"{GRAPHS} too (or fairseq's transformer with {GRAPHS}) in "
                             f"torch.compile's mode reduce-overhead (CUDA graphs on a GPU)")
    parser.add_argument("--logic-tokens", type=int, default=2048,
                        help="logic, cpvr: source tokens per batch (the recipe's --max-tokens)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="logic, cpvr: torch thread counts to run at")
    parser.add_argument("--halting-bias", type=float, default=0.5,
                        help="logic, cpvr: bias of the halting units (sets the mean depth)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="wmt: where to run (cuda: the Triton expert kernels)")
    parser.add_argument("--bf16", action="store_true",
                        help="wmt, logic: parameters and activations in bfloat16 (fairseq's --bf16)")
    parser.add_argument("--compile", nargs="*", default=None, metavar="ARCH",
                        help="wmt, logic: after the eager timing, time the models compiled (the "
                             "plugin's with --compile-step, fairseq's transformer through "
                             "torch.compile; every timed model, or the ARCHs named), print the "
                             "seconds of each first (compiling) step, the compiled ratios and, "
                             "for the logic SUT, its step's graph breaks")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="wmt: after the timing, profile one step per model and print its N "
                             "most expensive operations (0: no profile)")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: the number of rows must be >= 0")
    if args.preset == "logic":
        return main_logic(args)
    if args.preset == "cpvr":
        return main_cpvr(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_step.py: --device cuda needs a CUDA device")
    device, dtype = torch.device(args.device), torch.bfloat16 if args.bf16 else torch.float32
    args.arch = args.arch or MODELS
    if args.compile is not None:
        compile_archs(args, args.arch)  # a model it names that is not timed: an error now
    sample = make_batch(args.batch, args.len, args.vocab, args.seed)
    tokens = sample["ntokens"]
    where = (torch.cuda.get_device_name() if device.type == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {where}, {'bf16' if args.bf16 else 'fp32'}; batch "
          f"{args.batch} x {args.len} = {tokens} target tokens")
    speed, peak, steps = {}, {}, {}
    for arch, t in time_steps(args.arch, sample, args.vocab, args.repeats, device=device,
                              dtype=dtype, peak_memory=peak, steps=steps).items():
        speed[arch] = tokens / t
        memory = f" {peak[arch] / 2 ** 30:7.2f} GiB peak" if arch in peak else ""
        print(f"{arch:24s} {1e3 * t:9.0f} ms/step {speed[arch]:9.0f} tokens/s{memory}", flush=True)
    if {"sut_base", "ut_base"} <= speed.keys():
        print(f"sut_base / ut_base tokens/s: {speed['sut_base'] / speed['ut_base']:.2f} (goal >= 2.0)")
    if {"sut_base", "transformer_wmt_en_de"} <= speed.keys():
        print(f"sut_base / transformer_wmt_en_de tokens/s: "
              f"{speed['sut_base'] / speed['transformer_wmt_en_de']:.2f} (goal >= 0.6)")
    fused = "transformer_wmt_en_de" + FUSED_CE
    if {"sut_base", fused} <= speed.keys():
        print(f"sut_base / {fused} tokens/s: {speed['sut_base'] / speed[fused]:.2f}")
    compiled_steps = {}
    if args.compile is not None:
        compiled = print_compiled(compile_archs(args, args.arch), sample, args.vocab, args, tokens,
                                  torch.get_num_threads(), "target", device, dtype, compiled_steps)
        for arch in compiled:
            print(f"{arch} compiled / eager tokens/s: {compiled[arch] / speed[arch]:.2f}")
        if any(GRAPHS in split_arch(a)[1] for a in compiled):
            print(f"CUDA graphs: {cudagraph_skips()} compiled graph(s) not replayed as CUDA graphs "
                  f"(inductor's cudagraph_skips; the reasons are the log's cudagraphs lines)")
        transformers = ("transformer_wmt_en_de", "transformer_wmt_en_de" + GRAPHS)
        eager_transformer = next((speed[t] for t in transformers if t in speed), None)
        for sut in ("sut_base", "sut_base" + LOOP, "sut_base" + LOOP + GRAPHS):
            for transformer in transformers:
                if {sut, transformer} <= compiled.keys():
                    print(f"compiled: {sut} / {transformer} tokens/s: "
                          f"{compiled[sut] / compiled[transformer]:.2f}")
            if sut in compiled and eager_transformer is not None:  # what fairseq-train runs
                print(f"compiled: {sut} / transformer_wmt_en_de(eager) tokens/s: "
                      f"{compiled[sut] / eager_transformer:.2f} (goal >= 0.6)")
    if args.profile:  # the timed models themselves, already warm; eager, then compiled
        for arch, step in [*steps.items(), *((f"compiled {a}", s) for a, s in compiled_steps.items())]:
            print_profile(arch, step, args.profile, cuda=device.type == "cuda")


if __name__ == "__main__":
    main()
