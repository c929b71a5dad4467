#!/usr/bin/env bash
# Multi30k English->German (docs/multi30k.md): the transformer, the SUT and the UT at
# matched compute, seeds 1-3, BLEU on every test set, the halting trade-off and decoding
# speed; stages data -> train -> evaluate -> report of scripts/multi30k/table.py.
#
#   LOCAL=path/to/multi30k scripts/multi30k/table.sh         # the CPU table (configs/multi30k)
#   LOCAL=... scripts/multi30k/table.sh --dry-run           # print every command, run nothing
#   LOCAL=... scripts/multi30k/table.sh --models sut --seeds 1 --core 0   # one run, pinned
#
# Variables: LOCAL (the Multi30k raw files: train/val/test_2016_flickr.{en,de}[.gz]),
# DATA (data/multi30k), WORK (runs/multi30k), PYTHON (python). Arguments go to table.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/table.py" --data-dir "${DATA:-data/multi30k}" --work-dir "${WORK:-runs/multi30k}")
if [ -n "${LOCAL:-}" ]; then RUN+=(--local-dir "$LOCAL"); fi
RUN+=("$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
