#!/usr/bin/env python3
"""Print the parameter count of every Table 5 model, built exactly as fairseq-train builds
it from the recipe's architecture options (``--arch`` and the model's flags, all
embeddings shared).

    python scripts/logic/params.py [--data DATA_BIN | --dict-size 24] [--models sut ...]
        [-- extra architecture options, e.g. --encoder-embed-dim 32]

The dictionary is ``DATA_BIN/dict.src.txt`` when ``--data`` is given, else a synthetic one
of ``--dict-size`` entries (24 = what fairseq-preprocess makes of the logic data: 4
special symbols, 19 tokens, padded to a multiple of 8). Counts are
``sum(p.numel() for p in model.parameters())`` (a shared embedding counts once). Needs
torch and fairseq.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logic_recipe as recipe  # noqa: E402

LOGIC_DICT_SIZE = 24


class _Task:
    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def count_parameters(model_name, dictionary, extra=()):
    """Parameter count of ``model_name`` (a recipe model) over ``dictionary``."""
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    import sut_fairseq  # noqa: F401  (registers the plugin's architectures)

    flags = recipe.merge_flags(recipe.model_arch_flags(model_name), list(extra))
    cli = ["/dev/null", "--task", "translation", *flags]
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=cli)
    model = ARCH_MODEL_REGISTRY[args.arch].build_model(args, _Task(dictionary))
    return sum(p.numel() for p in model.parameters())


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="binarized data directory (its dict.src.txt)")
    parser.add_argument("--dict-size", type=int, default=LOGIC_DICT_SIZE)
    parser.add_argument("--models", nargs="+", default=list(recipe.MODELS), choices=recipe.ALL_MODELS)
    args = parser.parse_args(argv)

    from fairseq.data import Dictionary

    if args.data:
        dictionary = Dictionary.load(os.path.join(args.data, "dict.src.txt"))
    else:
        dictionary = Dictionary()
        for i in range(args.dict_size - len(dictionary)):
            dictionary.add_symbol(f"w{i}")
    print(f"dictionary: {len(dictionary)} entries, all embeddings shared")
    print("| model | --arch | parameters |")
    print("|---|---|---:|")
    counts = {}
    for name in args.models:
        counts[name] = count_parameters(name, dictionary, extra)
        print(f"| {recipe.label(name)} | {recipe.load_model(name)['arch']} | {counts[name]:,} |",
              flush=True)
    return counts


if __name__ == "__main__":
    main()
