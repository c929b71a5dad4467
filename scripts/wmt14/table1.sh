#!/usr/bin/env bash
# Reproduce the paper's Table 1 (WMT'14 En-De): train and evaluate the five models in turn.
#
#   PREP=data/wmt14_en_de NGPUS=8 scripts/wmt14/table1.sh            # runs everything
#   PREP=data/wmt14_en_de NGPUS=8 DRY_RUN=1 scripts/wmt14/table1.sh  # prints the commands
#
# PREP: data-prep/wmt14_en_de/prepare.py --workdir (holds data-bin/, tok/, raw/)
# NGPUS, MAX_TOKENS (default 8192): the update frequency is derived from them (train.py)
# MODELS: a subset, e.g. MODELS="sut_base ut_base"; CKPT: checkpoint root; RESULTS: table file
# Extra arguments are passed to train.py (e.g. -- --max-update 100 for a smoke run).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
PREP="${PREP:?set PREP to the data-prep workdir}"
NGPUS="${NGPUS:-1}"
MAX_TOKENS="${MAX_TOKENS:-8192}"
CKPT="${CKPT:-checkpoints/wmt14}"
RESULTS="${RESULTS:-$CKPT/table1.md}"
MODELS="${MODELS:-transformer ut_base sut_base ut_big sut_big}"
DRY=()
[[ "${DRY_RUN:-0}" != 0 ]] && DRY=(--dry-run)

for model in $MODELS; do
    "$PY" "$HERE/train.py" "$model" --data "$PREP/data-bin" --ngpus "$NGPUS" \
        --max-tokens "$MAX_TOKENS" --save-dir "$CKPT/$model" "${DRY[@]}" "$@"
    "$PY" "$HERE/evaluate.py" --checkpoint-dir "$CKPT/$model" --data "$PREP/data-bin" \
        --prep-dir "$PREP" --name "$model" --table "$RESULTS" "${DRY[@]}"
done
[[ "${DRY_RUN:-0}" != 0 ]] || cat "$RESULTS"
