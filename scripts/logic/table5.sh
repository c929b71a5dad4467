#!/usr/bin/env bash
# Paper Table 5 and Figure 4 (logical inference, docs/logic.md) at the paper's scale on one
# GPU: the SUT, the UT with and without halting and the transformer in the `full`
# configuration, on the standard protocol (buckets 7-12) and the compositional splits
# A, B, C; stages data -> train -> evaluate -> report of scripts/logic/table5.py.
#
#   scripts/logic/table5.sh                                  # generates data/logic if missing
#   scripts/logic/table5.sh --dry-run                        # print every command, run nothing
#   scripts/logic/table5.sh --reduced --protocols standard --buckets all   # the 2-core CPU run
#
# Variables: DATA (data/logic), WORK (runs/logic), PYTHON (python). Arguments go to table5.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/table5.py" --data-dir "${DATA:-data/logic}" --work-dir "${WORK:-runs/logic}"
     --setup seq2seq --models sut ut-halting ut-no-halting transformer --protocols standard A B C "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
