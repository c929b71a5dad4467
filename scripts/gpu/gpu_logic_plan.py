"""The plan of the two logic stages (``logic-sut``, ``logic-baselines``): their runs of
the Table 5 recipe (``scripts/logic/table5.py``), the time estimates behind the plan and
the tiny sizes of ``--smoke``."""
import os

from gpu_common import UsageError, recipe_module

#: logic stages. generate.py --pairs 500000: measured 16.4 s on an H100 node (8 s on the
#: 2-core machine: the node's cores are slower one by one).
LOGIC_GENERATE_ESTIMATE_S = 20
#: prepare.py --binarize (one fairseq-preprocess): measured 50.5 s for the standard
#: protocol and 40.7 s for A on an H100 node; B and C binarize about as much as A.
LOGIC_PREPARE_ESTIMATE_S = {"standard": 55, "A": 45, "B": 45, "C": 45}
#: The training budget of every run: fairseq-train --stop-time-hours LOGIC_TRAIN_CAP_S/3600.
#: The same for every model (rows compare at an equal GPU-time budget); the full
#: configuration's --max-update 50,000 is never reached at this cap, and its 4,000 warm-up
#: updates are not finished either: these runs check the recipe on the GPU and measure
#: its speed (updates/s in fairseq-train.log); they do not reproduce Table 5. 40 s (60 until
#: the H100 install measured 177 s) keeps both required runs of each logic stage within
#: the deadline after a fresh install.
LOGIC_TRAIN_CAP_S = 40
#: fairseq-train beyond the cap: start-up (imports, data, CUDA), the final validation on
#: the whole valid split and the checkpoint save. Measured on an H100 node: 33 s from the
#: step's start to fairseq's "begin training" (the first process after the install also
#: compiles the installed modules' bytecode).
LOGIC_TRAIN_OVERHEAD_S = 35
#: One fairseq-generate call: measured about 19 s on an H100 node (imports, CUDA, the
#: checkpoint, the Triton kernels' compilation for the inference launches, greedy decoding
#: of a test bucket 256 pairs at a time). The standard protocol makes one call per bucket
#: evaluated, a compositional split one.
LOGIC_GENERATE_CALL_S = 20
#: Teacher-forced halting analysis on the CPU (the recipe keeps it there) of the buckets
#: evaluated: a guess sized for all 13 (about 37,500 pairs; buckets 7-12 alone are about
#: 13,500), not yet measured on a node.
LOGIC_ANALYSIS_ESTIMATE_S = 30
#: summarize.py (Table 5, table5.json, Figure 4 into OUT).
LOGIC_SUMMARY_ESTIMATE_S = 10
#: What the logic stages evaluate on the standard protocol (table5.py --buckets): the
#: first and the last of Table 5's out-of-distribution columns. All 13 buckets ("all") took
#: 13 calls, about 250 s per model, more than a stage can spend.
LOGIC_BUCKETS = "7,12"
LOGIC_PAIRS = 500_000
#: The runs of each logic stage, in order: (model, protocol, required). Optional runs are
#: started only when their estimate fits in the time left. With the estimates above
#: (install + environment + data + runs + summary; required_estimate() adds them up):
#: logic-sut ~ 180 + 10 + 20 + 10 + 55 + (35 + 40 + 2 x 20 + 30) = 420 s with its required
#: run; split A (45 + 35 + 40 + 20 = 140 s more) runs only when the install was skipped (a
#: warm machine) or the estimates prove pessimistic. logic-baselines' required runs ~ 180
#: + 10 + 20 + 10 + 55 + (35 + 40 + 40) + (35 + 40 + 40 + 30) = 535 s, so its A runs and
#: ut-no-halting run only on a warm machine. With 40 s of training per run there is no
#: room for more in one 10-minute command: call the stage again with SUT_LOGIC_MODELS /
#: SUT_LOGIC_PROTOCOLS (e.g. SUT_LOGIC_PROTOCOLS=A) for the rest. (Until the H100 lease
#: of checkout 6ec6c85 measured the data steps and fairseq-generate calls, split A was
#: required too and every bucket was evaluated: the standard run then spent its time in
#: its 13 fairseq-generate calls and neither run finished.)
LOGIC_SUT_RUNS = [("sut", "standard", True), ("sut", "A", False)]
LOGIC_BASELINE_RUNS = [("transformer", "standard", True), ("ut-halting", "standard", True),
                       ("transformer", "A", False), ("ut-halting", "A", False),
                       ("ut-no-halting", "standard", False), ("ut-no-halting", "A", False)]

# --smoke sizes
SMOKE_PAIRS = 3000
SMOKE_BUCKETS = "0,12"            # bucket 0 is the split named `test`, 12 is `test12`
SMOKE_MAX_UPDATE = 3
SMOKE_STOP_TIME_HOURS = 0.05      # a cap only; the 3 updates take seconds
#: tiny models (the flags replace the recipe's values; fairseq-train runs with --cpu)
SMOKE_TRAIN_ARGS = {
    "sut": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 --att-experts 4 "
           "--att-topk 2 --att-heads 2 --att-head-dim 8 --ffd-experts 4 --ffd-topk 2 "
           "--ffd-hidden-dim 32 --max-tokens 1024",
    "ut-halting": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 --att-heads 2 "
                  "--att-head-dim 8 --ffd-hidden-dim 32 --max-tokens 1024",
    "ut-no-halting": "--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 32 "
                     "--att-heads 2 --att-head-dim 8 --ffd-hidden-dim 32 --max-tokens 1024",
    "transformer": "--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
                   "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
                   "--encoder-attention-heads 2 --decoder-attention-heads 2 --max-tokens 1024",
}


ORIGINAL_FILES = [f"{p}{k}" for p in ("train", "test") for k in range(13)]


def logic_plan(stage_name, smoke, environ=None):
    """The runs of a logic stage: [(model, protocol, required)]."""
    environ = os.environ if environ is None else environ
    plan = list(LOGIC_SUT_RUNS if stage_name == "logic-sut" else LOGIC_BASELINE_RUNS)
    models = environ.get("SUT_LOGIC_MODELS", "").split()
    protocols = environ.get("SUT_LOGIC_PROTOCOLS", "").split()
    if models or protocols:
        models = models or list(dict.fromkeys(m for m, _, _ in plan))
        protocols = protocols or list(dict.fromkeys(p for _, p, _ in plan))
        plan = [(m, p, True) for p in protocols for m in models]
    if smoke:  # the tiny CPU run: the required runs only
        plan = [r for r in plan if r[2]]
    return plan


def has_halting_analysis(model):
    """Whether a model's evaluation runs the teacher-forced halting analysis."""
    return model != "transformer"


def bucket_count(buckets):
    """How many buckets a table5.py --buckets value names ("all", "7..12", "7,12", "3"),
    counted with the recipe's own parser (``sut_fairseq/recipes/numbers.py``)."""
    return 13 if buckets == "all" else len(recipe_module("numbers").parse_numbers(buckets))


def run_estimate(model, protocol, smoke=False):
    """Estimated seconds of one table5.py call (train + evaluate one model, one protocol)."""
    if smoke:
        return 40
    if protocol == "standard":
        n = bucket_count(LOGIC_BUCKETS)
        evaluation = n * LOGIC_GENERATE_CALL_S + (LOGIC_ANALYSIS_ESTIMATE_S if has_halting_analysis(model) else 0)
    else:
        evaluation = LOGIC_GENERATE_CALL_S
    return LOGIC_TRAIN_OVERHEAD_S + LOGIC_TRAIN_CAP_S + evaluation


def validate_logic_names(plan):
    """A usage error for a model or protocol the recipe does not know."""
    models = ("sut", "ut-halting", "ut-no-halting", "transformer")
    for model, protocol, _ in plan:
        if model not in models:
            raise UsageError(f"SUT_LOGIC_MODELS: unknown model {model!r} (choose from {', '.join(models)})")
        if protocol not in ("standard", "A", "B", "C"):
            raise UsageError(f"SUT_LOGIC_PROTOCOLS: unknown protocol {protocol!r} (standard, A, B, C)")

