"""scripts/listops/depth.py, the ListOps halting depth per tree depth: the tree-depth parser
on hand-worked expressions, the aggregation per tree depth and over seeds against hand
computations, and tiny random models saved as fairseq checkpoints (a depth-wise UT and a
chunked per-token-halting encoder) whose reported depths must equal the executed steps
read from the model one example at a time."""
import json
import os
import random

import pytest
import torch

from conftest import randomise_halting
from split_recipes import ROOT, load_script

depth = load_script(os.path.join(ROOT, "scripts", "listops", "depth.py"), "listops_depth")

from sut_fairseq.data import listops  # noqa: E402

TOKENS = list(listops.OPERATORS) + [listops.CLOSE] + list(listops.DIGITS)


# --------------------------------------------------------------------------- tree depth

def sample(rng, max_args, max_depth, max_length):
    """One generated expression's tokens (the generator returns None for a too long one)."""
    while True:
        tokens = listops.sample_tokens(rng, max_args, max_depth, max_length)
        if tokens is not None:
            return tokens


@pytest.mark.parametrize("source,expected", [
    ("[SM 1 2 3 4 5 ]", 1),                                   # flat: one list of digits
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 2),
    ("[MIN [MAX 1 2 ] [MED [SM 3 4 ] 5 ] ]", 3),              # the deeper of two siblings
    ("[MAX [MIN [SM 1 2 ] 3 ] [MED 4 5 ] ]", 3),              # deepest first, then back up
    ("[MED 1 [SM 2 [MAX 3 [MIN 4 5 ] ] ] [SM 6 7 ] ]", 4),
    ("  [MAX   1 2 ]  ", 1),                                  # any whitespace between tokens
])
def test_tree_depth_of_hand_worked_expressions(source, expected):
    assert depth.tree_depth(source) == expected


def test_tree_depth_of_the_deepest_nesting_the_generator_makes():
    # generator depth 20: lists nest at most 19 deep (the near-IID split's deepest, 65 examples)
    ops = ["[MAX", "[MIN", "[MED", "[SM"]
    source = " ".join(f"{ops[k % 4]} {k % 10}" for k in range(19)) + " 7" + " ]" * 19
    assert depth.tree_depth(source) == 19
    assert listops.evaluate(source.split()) in range(10)      # a well-formed expression
    # inside one more list, beside a sibling one deep: 20
    assert depth.tree_depth("[SM " + source + " [MAX 1 2 ] ]") == 20


def test_tree_depth_agrees_with_the_generators_count():
    rng = random.Random("depth")
    seen = set()
    for _ in range(300):
        tokens = sample(rng, 5, 20, 300)
        seen.add(listops.depth(tokens))
        assert depth.tree_depth(" ".join(tokens)) == listops.depth(tokens)
    assert len(seen) >= 6


@pytest.mark.parametrize("source", [
    "[MAX 1 2", "[MAX 1 ] ]", "] [MAX 1 2 ]", "[MAX 1 x ]", "", "[MAX 1 12 ]",
    "] [MAX [MIN 1 2 ]",                   # balanced in count, but closes before it opens
])
def test_tree_depth_refuses_malformed_lines(source):
    with pytest.raises(ValueError):
        depth.tree_depth(source)


# --------------------------------------------------------------------------- aggregation

def records(tree_depths, depths, lengths=None):
    lengths = lengths or [10] * len(depths)
    return [{"tree_depth": t, "depth": d, "position_depth": d / 2, "length": n}
            for t, d, n in zip(tree_depths, depths, lengths)]


def test_per_tree_depth_is_the_mean_over_the_examples_of_each_depth():
    table = depth.per_tree_depth(records([3, 1, 3, 1, 2, 3], [1, 2, 2, 5, 3, 6]))
    assert list(table) == [1, 2, 3]                                  # increasing tree depth
    assert table[1] == {"mean": 3.5, "examples": 2}                 # (2 + 5) / 2
    assert table[2] == {"mean": 3.0, "examples": 1}
    assert table[3] == {"mean": 3.0, "examples": 3}                 # (1 + 2 + 6) / 3
    halves = depth.per_tree_depth(records([3, 1, 3, 1, 2, 3], [1, 2, 2, 5, 3, 6]), "position_depth")
    assert halves[1]["mean"] == 1.75


def test_over_seeds_takes_mean_and_sample_sd_of_the_seed_means():
    seed1 = depth.per_tree_depth(records([1, 1, 2], [3, 4, 2]))     # depth 1: 3.5, depth 2: 2
    seed2 = depth.per_tree_depth(records([1, 2, 2, 5], [1.5, 2, 4, 9]))  # 1: 1.5, 2: 3, 5: 9
    out = depth.over_seeds([seed1, seed2])
    assert list(out) == [1, 2, 5]
    assert out[1]["mean"] == 2.5 and out[1]["sd"] == pytest.approx(2 ** 0.5)  # 3.5 and 1.5
    assert out[1]["per_seed"] == [3.5, 1.5] and out[1]["examples"] == [2, 1]
    assert out[2]["mean"] == 2.5 and out[2]["sd"] == pytest.approx(0.5 ** 0.5)  # 2 and 3
    assert out[5] == {"mean": 9.0, "sd": 0.0, "seeds": 1, "per_seed": [9.0], "examples": [1]}


def test_partial_correlation_by_hand():
    # (0.5 - 0.2 * 0.4) / sqrt((1 - 0.04) (1 - 0.16)) = 0.42 / 0.898
    assert depth.partial_rho(0.5, 0.2, 0.4) == pytest.approx(0.42 / (0.96 * 0.84) ** 0.5)
    assert depth.partial_rho(0.5, 0.5, 0.5) == pytest.approx(1 / 3)
    assert depth.partial_rho(0.5, 1.0, 0.5) is None and depth.partial_rho(None, 0.1, 0.1) is None
    # depth follows the length only: rho 1 with the length, the tree depth adds nothing
    rec = records([1, 3, 2, 5, 4], [1, 2, 3, 4, 5], lengths=[5, 6, 7, 8, 9])
    c = depth.correlations(rec)
    assert c["length"] == pytest.approx(1.0) and c["tree_depth"] == pytest.approx(0.8)
    assert c["tree_depth_given_length"] is None               # the length explains it all
    rec = records([1, 2, 3, 4, 5], [1, 3, 2, 5, 4], lengths=[5, 9, 6, 7, 8])
    c = depth.correlations(rec)        # rho 1 - 6 sum d^2 / (n (n^2 - 1)): d^2 4, 8; tree~length 12
    assert c["tree_depth"] == pytest.approx(0.8) and c["length"] == pytest.approx(0.6)
    assert c["tree_depth_given_length"] == pytest.approx((0.8 - 0.6 * 0.4) / ((1 - 0.36) * (1 - 0.16)) ** 0.5)


def test_batches_longest_first_within_both_limits():
    lengths = [5, 30, 12, 12, 2, 40, 7]
    out = depth.batches(lengths, batch_size=3, max_tokens=60)
    assert sorted(i for b in out for i in b) == list(range(7))
    assert [i for b in out for i in b] == [5, 1, 2, 3, 6, 0, 4]   # by length, ties by index
    # 40 + 30: 80 padded tokens > 60; 30 + 12: 2 x 30 = 60; 12 + 12 + 7 + 5: 4 sentences > 3
    assert out == [[5], [1, 2], [3, 6, 0], [4]]
    for b in out:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60)


# --------------------------------------------------------------------------- tiny models

TINY = dict(encoder_embed_dim=16, att_heads=2, att_head_dim=8, ffd_hidden_dim=32, encoder_layers=4,
            decoder_layers=1, encoder_halting="stick-breaking", share_all_embeddings=True,
            halting_threshold=0.5, dropout=0.0)
CHUNKED = dict(encoder_chunk_size=4, encoder_memory_slots=3, encoder_memory_update_layers=1,
               tlb_encoder_out="memory")


def write_dictionaries(data_bin):
    os.makedirs(data_bin, exist_ok=True)
    for side in ("src", "tgt"):
        with open(os.path.join(data_bin, f"dict.{side}.txt"), "w") as f:
            f.writelines(f"{t} 1\n" for t in TOKENS)


def save_checkpoint(path, data_bin, seed, **options):
    """A randomly initialised ut_cpvr saved as fairseq-train saves one (its Namespace)."""
    from fairseq import tasks

    from sut_fairseq.models.standalone import model_args

    args = model_args("ut_cpvr", **{**TINY, **options})
    args.data, args.source_lang, args.target_lang = data_bin, "src", "tgt"
    torch.manual_seed(seed)
    model = tasks.setup_task(args).build_model(args)
    randomise_halting(model, std=4.0, seed=seed)
    model.eval()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"args": args, "model": model.state_dict(), "extra_state": {}, "last_optimizer_state": None,
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, path)
    return model


def expressions(n, seed=3):
    rng = random.Random(seed)
    return [" ".join(sample(rng, 4, 6, 40)) for _ in range(n)]


def alone(model, dictionary, source):
    """The encoder's executed steps per position and, chunked, per chunk, for one example
    run by itself (no batch, no padding)."""
    tokens = dictionary.encode_line(source, add_if_not_exist=False, append_eos=True).long()[None]
    with torch.no_grad():
        h = model.encoder(tokens, torch.tensor([tokens.size(1)]))["halting"][0]
    chunks = h.chunk_steps[0].tolist() if getattr(h, "chunk_real", None) is not None else None
    return h.steps[0].tolist(), chunks


@pytest.mark.parametrize("chunked", [False, True], ids=["depth-wise", "chunked"])
def test_reported_depths_are_the_models_executed_steps(tmp_path, chunked):
    data_bin = str(tmp_path / "bin")
    write_dictionaries(data_bin)
    save_checkpoint(str(tmp_path / "ck.pt"), data_bin, seed=1, **(CHUNKED if chunked else {}))
    model, dictionary = depth.load_checkpoint(str(tmp_path / "ck.pt"), data_bin)
    sources = expressions(24)
    got = depth.example_depths(model, dictionary, sources, batch_size=5)   # padded batches
    assert len(got) == len(sources)
    uneven = 0
    for source, record in zip(sources, got):
        steps, chunk_steps = alone(model, dictionary, source)
        assert record["tree_depth"] == listops.depth(source.split())
        assert record["length"] == len(source.split()) and record["positions"] == len(steps)
        assert record["steps"] == sum(steps)
        assert record["position_depth"] == pytest.approx(sum(steps) / len(steps))
        if chunked:
            assert len(chunk_steps) == -(-len(steps) // 4)             # chunks of 4 (</s> counted)
            assert record["chunks"] == len(chunk_steps) and record["chunk_steps"] == sum(chunk_steps)
            assert record["depth"] == pytest.approx(sum(chunk_steps) / len(chunk_steps))
            uneven += record["depth"] != record["position_depth"]
        else:
            assert "chunks" not in record and record["depth"] == record["position_depth"]
            uneven += len(set(steps)) > 1
    assert uneven >= 3          # positions halt at different steps: the means are not trivial
    if chunked:
        return
    # the threshold is the checkpoint's unless given: at 0.999 nothing halts before L = 4
    model, dictionary = depth.load_checkpoint(str(tmp_path / "ck.pt"), data_bin, threshold=0.999)
    assert {r["depth"] for r in depth.example_depths(model, dictionary, sources[:6])} == {4.0}


def test_example_depths_refuses_tokens_outside_the_dictionary(tmp_path):
    from fairseq.data import Dictionary

    write_dictionaries(str(tmp_path))
    dictionary = Dictionary.load(str(tmp_path / "dict.src.txt"))
    assert depth.encode(dictionary, ["[MAX 1 2 ]"])[0].tolist() == [
        dictionary.index(t) for t in ("[MAX", "1", "2", "]")] + [dictionary.eos()]
    with pytest.raises(ValueError, match="line 2"):   # before any model runs
        depth.example_depths(None, dictionary, ["[MAX 1 2 ]", "[MAX 1 [AND 2 ] ]"])


def test_main_over_seeds_end_to_end(tmp_path, capsys):
    from fairseq.data import Dictionary

    data, work = tmp_path / "data", tmp_path / "work"
    write_dictionaries(str(data / "bin"))
    dictionary = Dictionary.load(str(data / "bin" / "dict.src.txt"))
    sources = expressions(16, seed=5)
    (data / "test-iid.src").write_text("".join(s + "\n" for s in sources))
    direct = {}
    for model, options in (("ut", {}), ("sut-chunked", CHUNKED)):
        for seed in (1, 2):
            ck = str(work / model / f"seed{seed}" / "checkpoints" / "checkpoint_best.pt")
            net = save_checkpoint(ck, str(data / "bin"), seed=seed, **options)   # as built, not loaded
            direct[model, seed] = [alone(net, dictionary, s) for s in sources]
    # fairseq-generate's count of seed 1 (as the evaluate stage stores it) is right, seed 2's is off
    for seed, extra in ((1, 0), (2, 1)):
        steps = sum(sum(s) for s, _ in direct["ut", seed])
        positions = sum(len(s) for s, _ in direct["ut", seed])
        (work / "ut" / f"seed{seed}" / "result.json").write_text(json.dumps(
            {"splits": {"test-iid": {"encoder_steps_executed": [steps + extra, 4 * positions]}}}))

    out = str(tmp_path / "report" / "depth")
    argv = ["--data-dir", str(data), "--work-dir", str(work), "--models", "ut", "sut-chunked",
            "--seeds", "1", "2", "--batch-size", "3", "--progress", "8", "--out", out]
    assert depth.main(argv) == 0
    printed = capsys.readouterr().out
    assert "   9 / 16 examples" in printed and "   16 / 16 examples" in printed  # batches of 3, every 8
    report = json.load(open(out + ".json"))
    assert report["seeds"] == [1, 2] and report["command"][-1] == out
    ut, sut = report["report"]["test-iid"]["ut"], report["report"]["test-iid"]["sut-chunked"]
    assert ut["depth_unit"] == "position" and sut["depth_unit"] == "chunk"
    assert ut["checks_equal"] == [True, False] and sut["checks_equal"] == [None, None]
    assert ut["label"] == "UT" and ut["max_steps"] == 4 and ut["examples"] == [16, 16]

    # the report against a hand computation from the steps read one example at a time
    trees = [listops.depth(s.split()) for s in sources]
    for model, entry, per in (("ut", ut["depth"], lambda s, c: sum(s) / len(s)),
                              ("sut-chunked", sut["depth"], lambda s, c: sum(c) / len(c)),
                              ("sut-chunked", sut["position_depth"], lambda s, c: sum(s) / len(s))):
        assert sorted(int(d) for d in entry) == sorted(set(trees))
        for d in set(trees):
            seed_means = []
            for seed in (1, 2):
                values = [per(s, c) for (s, c), t in zip(direct[model, seed], trees) if t == d]
                seed_means.append(sum(values) / len(values))
            mean = sum(seed_means) / 2
            sd = abs(seed_means[0] - seed_means[1]) / 2 ** 0.5
            cell = entry[str(d)]
            assert cell["mean"] == pytest.approx(mean) and cell["sd"] == pytest.approx(sd)
            assert cell["examples"] == [trees.count(d)] * 2
    run = json.load(open(work / "ut" / "seed2" / "depth-test-iid.json"))
    assert [r["steps"] for r in run["records"]] == [sum(s) for s, _ in direct["ut", 2]]
    assert run["threshold"] == 0.5 and run["whole_split"] and run["check"]["equal"] is False
    assert open(out + "-test-iid.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(out + ".md").read()
    assert "| tree depth | examples | UT, L 4 | SUT (chunked), L 4, per chunk | SUT (chunked), per position |" in text
    first = min(trees)
    assert f"| {first} | {trees.count(first)} | {ut['depth'][str(first)]['mean']:.2f} ± " in text

    # a second call reuses the runs; fewer examples redo them
    depth.main(argv)
    assert capsys.readouterr().out.count("done before") == 4
    depth.main([*argv[:5], "ut", "--seeds", "1", "--out", out + "-5", "--max-examples", "5"])
    printed = capsys.readouterr().out
    assert "done before" not in printed and "on 5 examples" in printed
    assert json.load(open(out + "-5.json"))["report"]["test-iid"]["ut"]["examples"] == [5]
    assert json.load(open(work / "ut" / "seed1" / "depth-test-iid.json"))["check"] is None
