#!/usr/bin/env bash
# Paper Table 1 on WMT'14 En-De (docs/wmt14.md): the transformer, ut_base, sut_base, ut_big
# and sut_big with the reference code's hyper-parameters and the paper's effective batch of
# 262,144 tokens per update (--update-freq follows from NGPUS); stages data -> train ->
# evaluate -> report of scripts/wmt14/tables.py.
#
#   scripts/wmt14/table1.sh                                  # 8 GPUs, data/wmt14_en_de
#   scripts/wmt14/table1.sh --dry-run                        # print every command, run nothing
#   NGPUS=32 scripts/wmt14/table1.sh --runs sut_base --stop-stage train
#
# Variables: PREP (data/wmt14_en_de), NGPUS (8), PYTHON (python). Arguments go to tables.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN=("${PYTHON:-python}" "$HERE/tables.py" 1 --prep "${PREP:-data/wmt14_en_de}" --ngpus "${NGPUS:-8}" "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
