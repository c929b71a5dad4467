"""A grid of models trained on one task under shared options: ``configs/TASK/``.

    configs/TASK/common.json   {"description", "task": [...], "flags": [...], "sut_flags": [...],
                                "configs": {NAME: {"description", "flags": [...], "sut_flags": [...],
                                                   "model_flags": {MODEL: [...]}}}}
    configs/TASK/MODEL.json    {"label", "description", "arch", "halting", "sut_options",
                                "model_flags": [...], "loss_flags": [...]}

Every run of a grid gets ``task + flags + sut_flags + configs[NAME].flags +
configs[NAME].sut_flags + --arch + model_flags + loss_flags + configs[NAME].model_flags[MODEL]
+ --seed`` (merged: an option given again replaces the earlier value), so the models of one
configuration differ only in their model and loss options and see the same batches for the
same number of updates. The optional per-model options of a configuration are for what
changes with the scale (a chunk size, a number of steps, a loss weight at paper scale). The
optional ``sut_flags`` are options of the plugin's models only (``--att-heads``,
``--rel-pos``, ...): a model whose MODEL.json says ``"sut_options": false`` (fairseq's
transformer) does not get them.
"""
import os
from typing import List, Optional, Sequence

from .commands import RecipeError, merge_flags, tool, user_dir
from .files import load_json

#: Options of common.json that shape the model (the rest is optimisation and logging).
MODEL_SHAPING_COMMON = ("--share-all-embeddings", "--encoder-normalize-before",
                        "--decoder-normalize-before")


class ModelGrid:
    """The models and configurations of ``config_dir`` (``models``: the names of its
    MODEL.json files a recipe offers, in the order it runs them)."""

    def __init__(self, config_dir: str, models: Sequence[str]):
        self.config_dir, self.models = config_dir, tuple(models)

    # ------------------------------------------------------------------ configs
    def common(self) -> dict:
        return load_json(os.path.join(self.config_dir, "common.json"))

    def configs(self) -> List[str]:
        return list(self.common()["configs"])

    def model(self, name: str) -> dict:
        if name not in self.models:
            raise RecipeError(f"unknown model {name!r}: choose from {', '.join(self.models)}")
        return load_json(os.path.join(self.config_dir, f"{name}.json"))

    def label(self, name: str) -> str:
        try:
            return self.model(name)["label"]
        except RecipeError:
            return name

    def has_halting(self, name: str) -> bool:
        return bool(self.model(name).get("halting"))

    # ------------------------------------------------------------------ commands
    def train_flags(self, model: str, config: str, seed: int = 1, save_dir: Optional[str] = None,
                    stop_time_hours: Optional[float] = None, max_update: Optional[int] = None,
                    cpu: bool = False, extra: Sequence[str] = ()) -> List[str]:
        """Every fairseq-train option after ``DATA`` for one run (merged: later wins)."""
        common, spec = self.common(), self.model(model)
        if config not in common["configs"]:
            raise RecipeError(f"unknown configuration {config!r}: choose from "
                              f"{', '.join(common['configs'])}")
        scale = common["configs"][config]
        sut = spec.get("sut_options", True)
        groups = [common["task"], common["flags"], common.get("sut_flags", []) if sut else [],
                  scale["flags"], scale.get("sut_flags", []) if sut else [],
                  ["--arch", spec["arch"]], spec["model_flags"], spec["loss_flags"],
                  scale.get("model_flags", {}).get(model, []), ["--seed", str(seed)]]
        if save_dir is not None:
            groups.append(["--save-dir", save_dir])
        if stop_time_hours is not None:
            groups.append(["--stop-time-hours", f"{stop_time_hours:g}"])
        if max_update is not None:
            groups.append(["--max-update", str(max_update)])
        if cpu:
            groups.append(["--cpu"])
        groups.append(list(extra))
        return merge_flags(*groups)

    def train_command(self, model: str, data_bin: str, config: str, seed: int = 1,
                      save_dir: Optional[str] = None, stop_time_hours: Optional[float] = None,
                      max_update: Optional[int] = None, cpu: bool = False,
                      extra: Sequence[str] = (), required: bool = True) -> List[str]:
        """fairseq-train for one model and configuration."""
        flags = self.train_flags(model, config, seed, save_dir, stop_time_hours, max_update, cpu, extra)
        return [tool("fairseq-train", required), data_bin, "--user-dir", user_dir(), *flags]

    def generate_command(self, data_bin: str, checkpoint: str, subset: str, batch_size: int,
                         flags: Sequence[str] = (), cpu: bool = False, extra: Sequence[str] = (),
                         required: bool = True) -> List[str]:
        """fairseq-generate over one whole split with the task options of common.json,
        the recipe's decoding ``flags`` and the user's ``extra`` ones."""
        merged = merge_flags(self.common()["task"],
                             ["--path", checkpoint, "--gen-subset", subset,
                              "--batch-size", str(batch_size)],
                             list(flags), ["--cpu"] if cpu else [], list(extra))
        return [tool("fairseq-generate", required), data_bin, "--user-dir", user_dir(), *merged]

    def model_arch_flags(self, model: str) -> List[str]:
        """``--arch``, the model's architecture options and the shared ones of common.json
        (embedding sharing, pre-LN): what builds the model, no optimisation."""
        spec = self.model(model)
        shared = [f for f in self.common()["flags"] if f in MODEL_SHAPING_COMMON]
        return ["--arch", spec["arch"], *spec["model_flags"], *shared]
