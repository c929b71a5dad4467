"""A tiny corpus in the Multi30k task-1 layout (``train``, ``val``, ``test_2016_flickr``
and one further test set, gzip and plain mixed), written by the tests of the Multi30k
preparation and recipe: English-like sentences of a small vocabulary and a word-for-word
"German" of them, so that every stage has real text to work on."""
import gzip
import os
import random

EN = ("a man woman dog child girl boy is are in on the with red blue green big small "
      "walks runs sits plays holds street park water ball grass").split()
DE = {w: w.upper()[::-1] + "en" for w in EN}


def sentence_pair(rng: random.Random):
    words = [rng.choice(EN) for _ in range(rng.randint(3, 9))]
    en = " ".join(words).capitalize() + "."
    de = " ".join(DE[w] for w in words).capitalize() + "."
    return en, de


def write_split(directory: str, name: str, pairs, gz: bool) -> None:
    for lang, side in (("en", 0), ("de", 1)):
        text = "".join(pair[side] + "\n" for pair in pairs)
        path = os.path.join(directory, f"{name}.{lang}" + (".gz" if gz else ""))
        if gz:
            with gzip.open(path, "wt", encoding="utf-8") as handle:
                handle.write(text)
        else:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)


#: split -> (pairs, gzip); the sizes keep the recipe's smoke test to seconds per stage
SPLITS = {"train": (240, True), "val": (20, False), "test_2016_flickr": (12, True),
          "test_2017_mscoco": (9, False)}


def write_multi30k(directory: str, seed: int = 1, splits=SPLITS) -> str:
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    for name, (n, gz) in splits.items():
        write_split(directory, name, [sentence_pair(rng) for _ in range(n)], gz)
    return directory
