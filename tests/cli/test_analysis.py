"""Analysis tools: the MACs hooks against hand counts, static and dynamic MACs, and — on a
``sut_tiny`` trained for 60 updates through fairseq-train — the threshold sweep (CSV, PNGs,
heat map), the expert report and MACs on real data."""
import csv
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

from conftest import make_model, randomise_halting

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
from sut_fairseq.analysis.macs import count_arch, count_call, count_forward, random_net_input

# ---------------------------------------------------------------------------------------
# hooks against hand counts


def test_moe_ffd_hook_equals_hand_count():
    from sut_fairseq.modules.moe_ffd import MoEFeedForward

    torch.manual_seed(0)
    d, D, E, k, h = 8, 6, 3, 2, 5
    layer = MoEFeedForward(d, D, E, k, h).eval()
    x = torch.randn(1, 7, d)
    active = torch.tensor([[1, 1, 0, 1, 1, 0, 1]], dtype=torch.bool)  # 5 running positions
    c = count_call(layer, lambda: layer(x, active))
    slots = 5 * k
    experts = slots * ((d * D + D) + (D * d + d))  # up and down projection with biases
    combine = slots * d  # gate-weighted sum of the k outputs
    router = 5 * ((d * h + h) + h * E)
    assert c.total == experts + combine + router == 1480
    assert c.parts["router"] == router and c.parts["ffd"] == experts + combine


@pytest.mark.parametrize("case", ["self", "cross"])
def test_momha_hook_equals_hand_count(case):
    from sut_fairseq.modules.momha import MixtureOfMultiHeadAttention

    torch.manual_seed(0)
    d, E, k, H, D, h = 8, 3, 2, 2, 4, 5
    if case == "self":  # 6 queries over 6 keys, clipped relative positions W = 2
        T, S, kv_dim = 6, 6, 8
        layer = MixtureOfMultiHeadAttention(d, kv_dim, E, k, H, D, h, relative="clipped", window=2)
        active = torch.tensor([[1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    else:  # cross-attention: 5 queries over 7 encoder states of width 6, no relative term
        T, S, kv_dim = 5, 7, 6
        layer = MixtureOfMultiHeadAttention(d, kv_dim, E, k, H, D, h)
        active = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)
    layer.eval()
    q, kv = torch.randn(1, T, d), torch.randn(1, S, kv_dim)

    def run():
        key, value = layer.project_kv(kv)  # shared K/V, run outside forward
        return layer(q, key, value, active)

    c = count_call(layer, run)
    A, inner = 4, H * D  # running queries, width of one expert
    slots = A * k
    kv_proj = 2 * S * (kv_dim * inner + inner)
    q_o = slots * (d * inner + inner) + slots * inner * d + slots * d + A * d  # + combine, o bias
    core = slots * H * (S * D + S + S * D)  # logits, softmax, weighted sum
    relative = slots * H * 5 * D if case == "self" else 0  # offsets -2..2 materialised
    router = A * ((d * h + h) + h * E)
    assert c.parts == {"ffd": 0, "att_proj": q_o, "kv": kv_proj, "att_core": core + relative,
                       "router": router, "halting": 0, "offramp": 0}
    assert c.total == kv_proj + q_o + core + relative + router
    if case == "self":
        assert c.total == 3472


def test_vanilla_transformer_equals_hand_count():
    """fairseq's transformer (its MultiheadAttention hooked, the rest ptflops' defaults)."""
    r = count_arch("transformer", src_len=5, tgt_len=4, dict_size=20, encoder_layers=1,
                   decoder_layers=1, encoder_embed_dim=8, decoder_embed_dim=8,
                   encoder_ffn_embed_dim=16, decoder_ffn_embed_dim=16, encoder_attention_heads=2,
                   decoder_attention_heads=2)["static"]
    lin = lambda rows, i, o: rows * (i * o + o)  # noqa: E731
    attn = lambda T, S: 2 * lin(T, 8, 8) + 2 * lin(S, 8, 8) + 2 * T * (S * 4 + S + S * 4)  # noqa: E731
    encoder = attn(5, 5) + lin(5, 8, 16) + lin(5, 16, 8) + 2 * 5 * 8  # + 2 LayerNorms
    decoder = attn(4, 4) + attn(4, 5) + lin(4, 8, 16) + lin(4, 16, 8) + 3 * 4 * 8 + 4 * 8 * 20
    assert r.total == encoder + decoder == 8322


# ---------------------------------------------------------------------------------------
# static and dynamic counts of whole models

def _per_slot(model):
    w1 = model.encoder.side.block.ffd.up.weight
    _, d, D = w1.shape
    return d * D + D + D * d + d + d


def test_static_counts_every_step():
    model = make_model(dict_size=40)
    randomise_halting(model)  # would halt early; static ignores it
    S, T = 7, 5
    net_input = random_net_input(model, S, T)
    c = count_forward(model, net_input, "static")
    L, k, d = model.encoder.side.num_steps, model.encoder.side.block.ffd.router.top_k, 64
    assert c.steps == {"encoder": (L * S, L * S), "decoder": (L * T, L * T)}
    assert c.parts["ffd"] == L * (S + T) * k * _per_slot(model)
    assert c.parts["halting"] == (L - 1) * (S + T) * (d * d + d + d + 1)
    assert model.encoder.side.halting.threshold == 0.999  # restored after the count


def test_dynamic_macs_fall_as_the_threshold_falls():
    model = make_model(dict_size=40, encoder_layers=4, decoder_layers=4)
    randomise_halting(model, seed=2)
    net_input = random_net_input(model, 12, 10, seed=1)
    static = count_forward(model, net_input, "static")
    counts = {t: count_forward(model, net_input, "dynamic", t) for t in (0.999, 0.9, 0.6, 0.3)}
    totals = [counts[t].total for t in (0.999, 0.9, 0.6, 0.3)]
    assert static.total >= totals[0]
    assert all(a > b for a, b in zip(totals, totals[1:])), totals
    k = model.encoder.side.block.ffd.router.top_k
    for c in counts.values():  # the expert rows counted are exactly the executed steps
        executed = c.steps["encoder"][0] + c.steps["decoder"][0]
        assert c.parts["ffd"] == executed * k * _per_slot(model)


def test_sut_big_differs_from_sut_base_only_in_the_routers():
    S, T, L, d = 6, 5, 6, 512
    base = count_arch("sut_base", S, T, dict_size=64)["static"]
    big = count_arch("sut_big", S, T, dict_size=64)["static"]
    assert big.total - big.parts["router"] == base.total - base.parts["router"]
    # only the routers' output layer (d -> E) grows: 24 more experts, per router row
    assert big.total - base.total == d * 24 * L * (2 * S + 3 * T)


def test_preset_ratios_to_the_vanilla_transformer_match_the_paper():
    """Table 1 (static, 32/32 tokens, 32,768 joined dictionary): within 15% of the paper."""
    counts = {a: count_arch(a, 32, 32)["static"].total
              for a in ("transformer_wmt_en_de", "sut_base", "ut_base", "ut_big")}
    vt = counts["transformer_wmt_en_de"]
    for arch, paper in (("sut_base", 787 / 604), ("ut_base", 1998 / 604), ("ut_big", 3707 / 604)):
        assert abs(counts[arch] / vt / paper - 1) < 0.15, (arch, counts[arch] / vt, paper)


def test_cli_prints_the_ratio_to_the_vanilla_transformer(capsys):
    from sut_fairseq.analysis import macs

    assert macs.main(["--arch", "sut_tiny", "--src-len", "6", "--tgt-len", "5", "--dict-size", "64",
                      "--mode", "both", "--threshold", "0.5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| sut_tiny \| [\d.]+[KMG]? \(", out)
    assert re.search(r"static MAC ratio sut_tiny / transformer_wmt_en_de = [\d.]+", out)


# ---------------------------------------------------------------------------------------
# on a trained sut_tiny

N_TEST = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from fairseq import options
    from fairseq_cli import preprocess

    from sut_fairseq.data.reverse_task import write_reverse_task
    from sut_fairseq.demo import train_command

    root = tmp_path_factory.mktemp("analysis")
    prefixes = write_reverse_task(str(root / "text"), seed=3,
                                  sizes={"train": 1500, "valid": 40, "test": N_TEST})
    data_bin = str(root / "bin")
    preprocess.main(options.get_preprocessing_parser().parse_args([
        "--source-lang", "src", "--target-lang", "tgt", "--trainpref", prefixes["train"],
        "--validpref", prefixes["valid"], "--testpref", prefixes["test"], "--destdir", data_bin,
        "--joined-dictionary", "--workers", "1"]))
    save_dir = str(root / "ckpt")
    command = train_command(data_bin, save_dir, 60, seed=1,
                            extra=["--max-tokens", "1024", "--warmup-updates", "20",
                                   "--disable-validation"])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return data_bin, os.path.join(save_dir, "checkpoint_last.pt"), root


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_sweep_writes_csv_and_pngs(trained):
    from sut_fairseq.analysis import sweep

    data_bin, ckpt, root = trained
    out = root / "sweep"
    assert sweep.main(["--path", ckpt, "--data", data_bin, "--metric", "accuracy",
                       "--thresholds", "0.4,0.999", "--example-id", "2", "--output-dir", str(out),
                       "--macs-sentences", "3"]) == 0
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["threshold"]) for r in rows] == [0.4, 0.999]
    low, high = rows
    assert int(low["sentences"]) == int(high["sentences"]) == N_TEST
    assert float(low["skipped"]) > float(high["skipped"]) >= 0.0
    assert float(low["macs_executed"]) < float(high["macs_executed"]) <= float(high["macs_static"])
    assert float(low["decode_executed_decoder"]) < float(high["decode_executed_decoder"])
    assert 0.0 <= float(low["metric"]) <= 100.0
    for name in ("tradeoff.png", "halting_heatmap.png"):
        width, height = _png_size(out / name)
        assert width > 300 and height > 200 and (out / name).stat().st_size > 10_000
    result = json.loads((out / "sweep.json").read_text())
    heat = result["heatmap"]
    assert heat["example_id"] == 2 and heat["threshold"] == 0.999
    for side, text in (("encoder", heat["source"]), ("decoder", heat["target"])):
        stick = heat[side]["remaining_stick"]
        assert heat[side]["tokens"] == text.split() + ["</s>"]
        assert len(stick) == 3 and all(len(row) == len(text.split()) + 1 for row in stick)  # L × positions
        assert all(v == 1.0 for v in stick[0]) and all(0.0 <= v <= 1.0 for row in stick for v in row)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


def test_sweep_rejects_an_example_outside_the_analysed_sentences_before_decoding(trained, tmp_path, monkeypatch):
    """--example-id must be among the --max-sentences analysed; the check comes before
    any fairseq-generate run (it used to fail only after the whole sweep)."""
    from sut_fairseq.analysis import sweep

    data_bin, ckpt, _ = trained
    decoded = []
    monkeypatch.setattr(sweep, "run_generate", lambda command, out: decoded.append(out) or {})
    with pytest.raises(SystemExit, match="example id 999 not analysed"):
        sweep.main(["--path", ckpt, "--data", data_bin, "--metric", "accuracy", "--thresholds",
                    "0.4,0.999", "--example-id", "999", "--max-sentences", "3",
                    "--output-dir", str(tmp_path / "s")])
    assert decoded == []


def test_expert_report(trained, tmp_path, capsys):
    from sut_fairseq.analysis import expert_report
    from sut_fairseq.analysis.halting_analysis import analyse, load

    data_bin, ckpt, _ = trained
    model, task = load(data_bin, ckpt, subset="test")
    co = expert_report.collect(model, task, "test", threshold=0.5)
    executed = analyse(model, task, "test", threshold=0.5)
    k = 2
    for name, counts in co.counts.items():
        side = executed[name.split()[0]]
        rows = round(side["mean_steps"] * side["positions"])  # executed (position, step) pairs
        assert int(counts.sum()) == k * rows, name  # halted rows go to no expert
    report = expert_report.build_report(co, task.source_dictionary, task.target_dictionary, top=3)
    assert set(report) == {"encoder self-attn", "encoder FFD", "decoder self-attn",
                           "decoder cross-attn", "decoder FFD"}
    ffd = report["encoder FFD"]["experts"]
    assert abs(sum(e["share"] for e in ffd) - 1.0) < 1e-9
    assert all(len(e["top"]) <= 3 for e in ffd) and any(e["top"] for e in ffd)
    symbols = set("abcdefghijkl") | {"</s>"}
    assert all(t["token"] in symbols for e in ffd for t in e["top"])

    path = tmp_path / "experts.json"
    assert expert_report.main(["--path", ckpt, "--data", data_bin, "--top", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "### encoder FFD (E = 4, k = 2" in out and "| expert | share of picks |" in out
    assert json.loads(path.read_text())["routers"]["decoder FFD"]["num_experts"] == 4


def test_expected_depth_is_the_halting_distribution_mean(trained):
    """Each position's recorded expected depth is Σ_l l · w_l of its recorded weights (the
    stick-breaking rule of sut_tiny), and halting_depth's mean_expected_depth is the mean
    over sentences of their positions' mean, computed here by hand."""
    from sut_fairseq.analysis.halting_analysis import analyse, load
    from sut_fairseq.analysis.halting_depth import depth_summary

    data_bin, ckpt, _ = trained
    model, task = load(data_bin, ckpt, subset="test")
    assert model.encoder.side.halting.rule != "act"
    analysis = analyse(model, task, "test", threshold=0.999)
    for s in analysis["sentences"]:
        for side in ("encoder", "decoder"):
            assert len(s[f"{side}_expected"]) == len(s[f"{side}_weights"])
            for depth, weights in zip(s[f"{side}_expected"], s[f"{side}_weights"]):
                assert abs(sum(weights) - 1.0) < 1e-5
                assert depth == pytest.approx(sum((l + 1) * w for l, w in enumerate(weights)), abs=1e-5)
    summary = depth_summary(analysis, {"encoder": 3, "decoder": 3})
    by_hand = [sum(s["encoder_expected"]) / len(s["encoder_expected"]) for s in analysis["sentences"]]
    assert summary["encoder"]["mean_expected_depth"] == pytest.approx(sum(by_hand) / len(by_hand))
    assert 1.0 <= summary["encoder"]["mean_expected_depth"] <= 3.0


def test_macs_on_real_data(trained, capsys):
    from sut_fairseq.analysis import macs

    data_bin, ckpt, _ = trained
    assert macs.main(["--path", ckpt, "--data", data_bin, "--max-sentences", "4",
                      "--threshold", "0.4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
    static = re.search(r"static MACs per sentence pair \(mean\): ([\d.]+)([KMG]?)", "\n".join(lines))
    # eval/model_info.py reads the last number of the last line that mentions MACs
    last = [l for l in lines if "mac" in l.lower()][-1]
    value, unit = re.findall(r"(\d[\d,]*(?:\.\d+)?)\s*([KMG]?)", last)[-1]
    assert 0 < float(value) * scale[unit] < float(static.group(1)) * scale[static.group(2)]
    assert "4 sentence pairs" in lines[0]


def test_decode_halting_benchmark_compares_time_per_position_with_the_steps_skipped(trained):
    """benchmarks/decode_halting.py on the trained checkpoint: the rows of both thresholds
    (every decoder step executed at 0.999, fewer at 0.4), the ratio line and the figure."""
    data_bin, ckpt, root = trained
    figure = str(root / "decode-halting.png")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_halting.py"),
                           "--path", ckpt, "--data", data_bin, "--sentences", "12", "--batch-size", "5",
                           "--beam", "2", "--thresholds", "0.999", "0.4", "--plot", figure],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.rstrip().endswith(f"trade-off figure: {figure}") and _png_size(figure)[0] > 100, out
    assert re.search(r"12 sentences of test in 3 batches, beam 2$", out, re.M), out
    rows = dict(re.findall(r"^alpha_thresh ([\d.]+): [\d.]+ sentences/s, \d+ decoder positions, \d+ "
                           r"us/position, decoder steps executed ([\d.]+)%", out, re.M))
    assert float(rows["0.999"]) == 100.0 and float(rows["0.4"]) < 100.0, out
    assert re.search(r"^alpha_thresh 0.4 against 0.999: time per position saved -?[\d.]+%, decoder steps "
                     r"skipped [\d.]+%; time saved per position / decoder steps skipped: -?[\d.]+$", out, re.M), out
    # the time inside the decoder's recurrence steps: a real part of the decoding, not all of it
    found = re.findall(r"^alpha_thresh ([\d.]+): .*; decoder steps [\d.]+ s, ([\d.]+)% of the time, "
                       r"output layer ([\d.]+)%$", out, re.M)
    shares = {t: steps for t, steps, _ in found}
    assert shares.keys() == {"0.999", "0.4"} and all(0 < float(v) < 100 for v in shares.values()), out
    assert all(0 < float(steps) + float(output) < 100 for _, steps, output in found), out
    bound = re.search(r"^  in the decoder steps alone: time saved -?[\d.]+%, time saved / steps skipped: "
                      r"-?[\d.]+ \(the whole decoding's ratio is at most about the steps' share of the "
                      r"time, ([\d.]+)\)$", out, re.M)
    assert bound and abs(float(bound.group(1)) - float(shares["0.999"]) / 100) < 0.006, out
    # where the time goes: the parts add up to the whole, the steps' part is the share above
    parts = re.findall(r"^  where the time goes: decoder steps ([\d.]+)%, output layer ([\d.]+)%, the "
                       r"decoder's other work ([\d.]+)%, encoder ([\d.]+)%, reorders ([\d.]+)%, "
                       r"log-softmax ([\d.]+)%, beam search ([\d.]+)%$", out, re.M)
    assert len(parts) == 2, out
    for (t, steps, output), row in zip(found, parts):
        assert row[0] == steps and row[1] == output, out
        assert all(float(p) >= 0 for p in row) and float(row[-1]) > 0 and abs(sum(map(float, row)) - 100) < 0.5, out
    # where the halted rows fall (only where a step ran with some rows halted; this small
    # model halts whole calls at once): never at 0.999, the two parts adding up otherwise
    halted = re.findall(r"^  halted rows in the decoder's steps: (\d+), ([\d.]+)% in steps on the running rows "
                        r"alone, ([\d.]+)% in steps with fewer than 25% of the rows halted \(block on every row\)$",
                        out, re.M)
    assert len(halted) <= 1 and all(abs(float(a) + float(b) - 100) < 0.11 for _, a, b in halted), out
    if halted:
        assert out.index("halted rows in the decoder's steps") > out.index("alpha_thresh 0.4:"), out


def test_decode_halting_plot_draws_relative_time_against_relative_steps(tmp_path, monkeypatch):
    """``decode_halting.plot``: one point per threshold at (steps executed, time per position),
    both over the first threshold's; the proportional line y = x and the steps-only line
    y = 1 - s (1 - x) with s the first threshold's steps' share; a bad --plot is refused."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import decode_halting
    from sut_fairseq.analysis import plots

    drawn = {}
    real_save = plots.savefig_atomic
    monkeypatch.setattr(plots, "savefig_atomic",
                        lambda fig, path: (drawn.update(lines=fig.axes[0].get_lines()), real_save(fig, path)))
    rows = {0.999: {"dec": 0.8, "per_position": 4e-4, "share": 0.6},
            0.5: {"dec": 0.6, "per_position": 3.4e-4, "share": 0.55},
            0.3: {"dec": 0.4, "per_position": 3e-4, "share": 0.5}}
    path = str(tmp_path / "tradeoff.png")
    decode_halting.plot(rows, [0.999, 0.5, 0.3], path, "test")
    proportional, steps_only, measured = drawn["lines"]
    assert list(measured.get_xdata()) == pytest.approx([1.0, 0.75, 0.5])
    assert list(measured.get_ydata()) == pytest.approx([1.0, 0.85, 0.75])
    assert list(proportional.get_xdata()) == list(proportional.get_ydata()) == pytest.approx([0.5, 1.0])
    assert list(steps_only.get_ydata()) == pytest.approx([1 - 0.6 * 0.5, 1.0])
    assert _png_size(path)[0] > 100
    for bad, message in (("figure.pdf", "the figure is a PNG file"), ("no/such/dir/f.png", "no directory")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_halting.py"),
                               "--path", "x.pt", "--data", "d", "--plot", str(tmp_path / bad)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"--plot {tmp_path / bad}: {message}" in proc.stderr, proc.stderr


def test_decode_halting_counts_where_the_halted_rows_fall(monkeypatch):
    """``HaltedRows``: the halted rows of incremental decoder steps, under ``compacted`` when
    the block runs on the running rows alone (at least a quarter halted), ``masked`` below;
    steps with no row or every row halted, and the encoder's calls, are not counted."""
    import types

    from sut_fairseq.modules import recurrence

    monkeypatch.setattr(recurrence, "running_rows", recurrence.running_rows)  # restored after
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import decode_halting

    counter = decode_halting.HaltedRows()
    decoding = types.SimpleNamespace(cache=object(), coords=None)
    query = torch.zeros(8, 1, 4)

    def step(halted, inputs=decoding):
        running = torch.ones(8, 1, dtype=torch.bool)
        running[:halted] = False
        return recurrence.running_rows(running, query, inputs, None, None)

    assert step(3).tolist() == [3, 4, 5, 6, 7]  # the rows returned as before
    assert (counter.compacted, counter.masked) == (3, 0)
    assert step(1) is None and (counter.compacted, counter.masked) == (3, 1)
    step(0), step(8)  # nothing halted, everything halted
    step(4, types.SimpleNamespace(cache=recurrence.NO_CACHE, coords=None))  # a full forward
    assert (counter.compacted, counter.masked) == (3, 1)
    counter.reset()
    assert (counter.compacted, counter.masked) == (0, 0)


def test_decode_halting_at_a_fixed_length_decodes_the_same_positions_at_every_threshold(trained):
    """``--fixed-length 6``: every hypothesis 6 tokens (+ end of sentence), so both thresholds
    make the same decoder calls on the same rows: 12 sentences x beam 2 x 7 positions."""
    data_bin, ckpt, _ = trained
    script = os.path.join(ROOT, "benchmarks", "decode_halting.py")
    common = [sys.executable, script, "--path", ckpt, "--data", data_bin, "--sentences", "12",
              "--batch-size", "5", "--beam", "2", "--thresholds", "0.999", "0.4"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(common + ["--fixed-length", "6", "--rounds", "2"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"in 3 batches, beam 2, every hypothesis 6 tokens$", out, re.M), out
    # pooled over the two rounds: twice the positions of one pass
    positions = dict(re.findall(r"^alpha_thresh ([\d.]+): [\d.]+ sentences/s, (\d+) decoder positions", out, re.M))
    assert positions == {"0.999": str(2 * 12 * 2 * 7), "0.4": str(2 * 12 * 2 * 7)}, out
    # each round's ratio and their median (the median of two: their mean)
    for what in ("time saved per position / decoder steps skipped", "in the decoder steps alone"):
        each = re.search(rf"^  each of the 2 rounds, {re.escape(what)}: (-?[\d.]+), (-?[\d.]+); median (-?[\d.]+)$",
                         out, re.M)
        assert each, out
        a, b, median = map(float, each.groups())
        assert abs((a + b) / 2 - median) <= 0.011, out  # each printed to 0.01
    assert "[round 2/2, batch 3/3]" in proc.stderr
    for flags, message in ((["--fixed-length", "0"], "--fixed-length 0: needs at least one token (L >= 1)"),
                           (["--rounds", "0"], "--rounds 0: needs at least one pass (N >= 1)"),
                           (["--thresholds", "0.999", "0.999"], "--thresholds 0.999 0.999: each threshold once")):
        bad = subprocess.run(common[:-3] + flags if flags[0] == "--thresholds" else common + flags,
                             capture_output=True, text=True, timeout=300, env=env)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def expert_weight_bytes(ckpt: str) -> int:
    """Bytes of the decoder block's six routed maps (MoMHA's query and output projections of
    both attentions, MoE-FFD's up and down), read from the checkpoint's state dict."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
    maps = ("self_attn.q_proj", "self_attn.o_proj", "cross_attn.q_proj", "cross_attn.o_proj", "ffd.up", "ffd.down")
    return sum(state[f"decoder.side.block.{name}.weight"].nbytes for name in maps)


def test_block_on_rows_benchmark_fits_a_part_per_call_and_a_part_per_row(trained):
    """benchmarks/block_on_rows.py on the trained checkpoint: the captured call's rows
    (12 sentences x beam 5), the block timed on each R asked for (clipped to the call's
    rows), the fitted line, the profile of the fewest rows (its expert products and the
    size of the block's expert weights); a position past the hypotheses' length is refused."""
    data_bin, ckpt, _ = trained
    script = os.path.join(ROOT, "benchmarks", "block_on_rows.py")
    common = [sys.executable, script, "--path", ckpt, "--data", data_bin, "--sentences", "12",
              "--fixed-length", "6", "--step", "2", "--repeats", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(common + ["--position", "3", "--rows", "100", "30", "4", "--halted", "0.5", "0.25",
                                    "--profile"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"step 2 of the decoder call at position 3, 60 rows \(12 sentences x beam 5\), "
                     r"4 cached positions$", out, re.M), out
    timed = re.findall(r"R=(\d+) [\d.]+ ms", out)
    assert timed == ["4", "30", "60"], out
    assert re.search(r"^cost\(R\) = -?[\d.]+ ms \+ -?[\d.]+ us x R; per-call share of a full block "
                     r"f = -?[\d.]+$", out, re.M), out
    halted = re.findall(r"^with ([\d.]+) halted: block on every row \(masked\) [\d.]+ ms, on the running "
                        r"rows [\d.]+ ms$", out, re.M)
    assert halted == ["0.5", "0.25"], out
    profiled = re.search(r"^profile of the block on 4 rows: (\d+) aten operators per call, [\d.]+ ms per call "
                         r"under the profiler\n  expert products: (\d+) per call, [\d.]+ us each, \d+% of the time; "
                         r"the block's expert weights ([\d.]+) MB, streamed at [\d.]+ GB/s\n  by self time: aten::",
                         out, re.M)
    assert profiled, out
    assert int(profiled.group(2)) > 0 and int(profiled.group(1)) > int(profiled.group(2)), out
    assert float(profiled.group(3)) == round(expert_weight_bytes(ckpt) / 2**20, 2), out
    bad = subprocess.run(common + ["--position", "6"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "--position 6: must be in [0, --fixed-length 6)" in bad.stderr
    bad = subprocess.run(common + ["--position", "3", "--halted", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "--halted 1.0: a share of the rows must be in (0, 1)" in bad.stderr
