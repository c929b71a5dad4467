#!/usr/bin/env bash
# Paper Table 2 on WMT'14 En-De (docs/wmt14.md): sut_base and its four ablations
# (configs/wmt14/ablations.json) with the paper's effective batch; stages data -> train ->
# evaluate -> report of scripts/wmt14/tables.py (the full row reuses Table 1's sut_base).
#
#   scripts/wmt14/table2.sh                                  # 8 GPUs, data/wmt14_en_de
#   scripts/wmt14/table2.sh --dry-run                        # print every command, run nothing
#
# Variables: PREP (data/wmt14_en_de), NGPUS (8), PYTHON (python). Arguments go to tables.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/tables.py" 2 --prep "${PREP:-data/wmt14_en_de}" --ngpus "${NGPUS:-8}" "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
