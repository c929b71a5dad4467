#!/usr/bin/env bash
# ListOps, the recurrent-transformers paper's Table 1 (docs/listops.md), at the paper's
# scale on one GPU: UT, GUT, TLB, GUTLB and the chunked SUT in the `full` configuration on
# the `paper` data; stages data -> train -> evaluate -> report of scripts/listops/table1.py.
#
#   scripts/listops/table1.sh                                # generates data/listops if missing
#   scripts/listops/table1.sh --dry-run                      # print every command, run nothing
#   scripts/listops/table1.sh --config cpu                   # the CPU experiment instead
#
# Variables: DATA (data/listops), WORK (runs/listops), PYTHON (python). Arguments go to table1.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/table1.py" --data-dir "${DATA:-data/listops}" --work-dir "${WORK:-runs/listops}"
     --config full "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
