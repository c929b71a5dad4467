#!/usr/bin/env bash
# C-PVR accuracy and halting depth per hop (the Hyper-UT paper's Figs. 3, 5 and 7;
# docs/cpvr.md) for the UT, the SUT and Hyper-UT with ACT halting, on the paper's App. G
# data (L 16, K 100, trained on hops 1-4, tested on 1-9) in the `cpu` configuration (one
# core per model); stages data -> train -> evaluate -> report of scripts/cpvr/hops.py.
#
#   scripts/cpvr/hops.sh                                     # generates data/cpvr if missing
#   scripts/cpvr/hops.sh --dry-run                           # print every command, run nothing
#   scripts/cpvr/hops.sh --models hyper-ut --max-update 10000
#
# Variables: DATA (data/cpvr), WORK (runs/cpvr), PYTHON (python). Arguments go to hops.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/hops.py" --data-dir "${DATA:-data/cpvr}" --work-dir "${WORK:-runs/cpvr}"
     --data-config small --config cpu "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
