#!/usr/bin/env bash
# The flip-flop language, the recurrent-transformers paper's Table 3 (docs/flipflop.md), at
# the paper's scale on one GPU: UT, GUT, TLB, GUTLB and the chunked SUT in the `full`
# configuration on the `paper` data (train length 512, tests at 512 and 1024), with the
# memory-reset control; stages data -> train -> evaluate -> report of scripts/flipflop/table3.py.
#
#   scripts/flipflop/table3.sh                               # generates data/flipflop if missing
#   scripts/flipflop/table3.sh --dry-run                     # print every command, run nothing
#   scripts/flipflop/table3.sh --config cpu                  # the CPU experiment instead
#
# Variables: DATA (data/flipflop), WORK (runs/flipflop), PYTHON (python). Arguments go to table3.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/table3.py" --data-dir "${DATA:-data/flipflop}" --work-dir "${WORK:-runs/flipflop}"
     --config full "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
