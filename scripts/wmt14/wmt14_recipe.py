"""The WMT'14 recipe's own parts: the configs in ``configs/wmt14/``, the models of Table 1,
the Table 2 ablations and the update-frequency arithmetic. Commands, stages, scoring and
summaries come from the shared recipe layer ``sut_fairseq.recipes`` (re-exported here for
the scripts in ``scripts/wmt14/``)."""
import math
import os
from typing import Dict

from sut_fairseq.recipes import (RecipeError, flag_values, format_command, load_json,  # noqa: F401
                                 merge_flags, parse_flags, run, show, tool, user_dir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs", "wmt14")
MODELS = ("transformer", "ut_base", "sut_base", "ut_big", "sut_big")  # Table 1 order


def load_config(name: str, config_dir: str = CONFIG_DIR) -> dict:
    return load_json(os.path.join(config_dir, name))


def load_model(model: str, config_dir: str = CONFIG_DIR) -> dict:
    if model not in MODELS:
        raise RecipeError(f"unknown model {model!r}: choose from {', '.join(MODELS)}")
    return load_config(f"{model}.json", config_dir)


def load_ablations(config_dir: str = CONFIG_DIR) -> Dict[str, dict]:
    return load_config("ablations.json", config_dir)["ablations"]


# --------------------------------------------------------------------------- batch size

def update_freq(ngpus: int, max_tokens: int, paper_gpus: int = 32, paper_max_tokens: int = 8192) -> int:
    """ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)): the gradient accumulation
    that makes the effective batch at least the paper's."""
    if ngpus < 1 or max_tokens < 1:
        raise RecipeError(f"--ngpus ({ngpus}) and --max-tokens ({max_tokens}) must be positive")
    return max(1, math.ceil(paper_gpus * paper_max_tokens / (ngpus * max_tokens)))


def batch_note(ngpus: int, max_tokens: int, freq: int, paper_gpus: int = 32,
               paper_max_tokens: int = 8192, explicit: bool = False) -> str:
    paper = paper_gpus * paper_max_tokens
    effective = ngpus * max_tokens * freq
    how = ("given" if explicit else
           f"ceil({paper_gpus}*{paper_max_tokens} / ({ngpus}*{max_tokens})) = {freq}")
    note = (f"update-freq {freq} ({how}): {ngpus} GPU(s) x {max_tokens} tokens x {freq} = "
            f"{effective:,} tokens per update (paper: {paper_gpus} x {paper_max_tokens} = {paper:,})")
    if effective != paper:
        note += f"; {effective / paper:.3f} x the paper's batch"
    return note


# --------------------------------------------------------------------------- subword model

#: The SentencePiece model that ``prepare.py --subword spm`` copies into its data-bin.
SPM_MODEL = "spm.model"
_PAD_ENTRY = "madeupword"  # fairseq's entries that pad a dictionary to a size multiple


def dictionary_entries(path: str) -> list:
    """The symbols of a fairseq dictionary file (first field of each line), without the
    ``madeupwordNNNN`` entries fairseq may append as padding."""
    if not os.path.isfile(path):
        raise RecipeError(f"missing fairseq dictionary {path}")
    with open(path, encoding="utf-8") as handle:
        entries = [line.split(" ", 1)[0] for line in handle.read().split("\n") if line]
    while entries and entries[-1].startswith(_PAD_ENTRY) and entries[-1][len(_PAD_ENTRY):].isdigit():
        entries.pop()
    return entries


def spm_pieces(model_path: str) -> list:
    """The pieces of SentencePiece model ``model_path`` in id order, without its control
    symbols (``<s>``, ``</s>``, ``<pad>``) and ``<unk>``: the entries its fairseq
    dictionary must hold. RecipeError naming the file if it is missing or unreadable."""
    if not os.path.isfile(model_path):
        raise RecipeError(f"missing SentencePiece model {model_path}")
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_path)
    except (OSError, RuntimeError) as err:
        raise RecipeError(f"cannot load SentencePiece model {model_path}: {err}") from err
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())
            if not (processor.is_control(i) or processor.is_unknown(i))]


def check_spm_model(model_path: str, data_dir: str, langs=("en", "de")) -> None:
    """RecipeError naming both files unless the fairseq dictionaries of ``data_dir``
    (``dict.LANG.txt``) list exactly the pieces of ``model_path``, in its id order."""
    pieces = spm_pieces(model_path)
    for lang in langs:
        dict_path = os.path.join(data_dir, f"dict.{lang}.txt")
        entries = dictionary_entries(dict_path)
        if entries == pieces:
            continue
        first = next((i for i, (a, b) in enumerate(zip(entries, pieces)) if a != b),
                     min(len(entries), len(pieces)))
        shown = (f"entry {first + 1} is {entries[first]!r} in the dictionary, "
                 f"{pieces[first]!r} in the model" if first < min(len(entries), len(pieces))
                 else "one is a prefix of the other")
        raise RecipeError(f"SentencePiece model {model_path} does not match the dictionary "
                          f"{dict_path} ({len(pieces)} pieces, {len(entries)} entries; {shown}): "
                          "the data was encoded with another model")


def subword_of(data_dir: str, requested: str = "auto", spm_model: str = None):
    """``("spm", model)`` or ``("bpe", None)``: the subword model the binarized data in
    ``data_dir`` was prepared with. ``auto`` is ``spm`` when ``data_dir/spm.model`` (or
    ``spm_model``) exists; a dictionary of SentencePiece pieces (``\u2581`` word
    prefixes) without its model is an error, never decoded as BPE. With ``spm`` the model
    is checked against the dictionaries (:func:`check_spm_model`)."""
    if requested not in ("auto", "bpe", "spm"):
        raise RecipeError(f"unknown subword model {requested!r}: choose auto, bpe or spm")
    model = spm_model or os.path.join(data_dir, SPM_MODEL)
    if requested == "auto":
        if os.path.isfile(model):
            requested = "spm"
        elif spm_model:
            raise RecipeError(f"missing SentencePiece model {spm_model}")
        else:
            dict_path = os.path.join(data_dir, "dict.de.txt")
            if os.path.isfile(dict_path) and any(e.startswith("\u2581") for e in dictionary_entries(dict_path)):
                raise RecipeError(f"{dict_path} holds SentencePiece pieces but the model {model} "
                                  "is missing (prepare.py --subword spm copies it there; or pass "
                                  "--spm-model PATH)")
            requested = "bpe"
    if requested == "bpe":
        return "bpe", None
    check_spm_model(model, data_dir)
    return "spm", model
