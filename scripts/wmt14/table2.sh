#!/usr/bin/env bash
# Reproduce the paper's Table 2 (ablations of SUT base on WMT'14 En-De): the full model and
# the four ablations (configs/wmt14/ablations.json), each trained and evaluated in turn.
#
#   PREP=data/wmt14_en_de NGPUS=8 scripts/wmt14/table2.sh
#   PREP=data/wmt14_en_de NGPUS=8 DRY_RUN=1 scripts/wmt14/table2.sh   # prints the commands
#
# The full row reuses $CKPT/sut_base when Table 1 already trained it (delete it to retrain).
# Valid loss: the best validation nll_loss is printed from each run's train.log.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
PREP="${PREP:?set PREP to the data-prep workdir}"
NGPUS="${NGPUS:-1}"
MAX_TOKENS="${MAX_TOKENS:-8192}"
CKPT="${CKPT:-checkpoints/wmt14}"
RESULTS="${RESULTS:-$CKPT/table2.md}"
ABLATIONS="${ABLATIONS:-full no-mim no-momha no-act no-halting}"
DRY=()
[[ "${DRY_RUN:-0}" != 0 ]] && DRY=(--dry-run)

for ablation in $ABLATIONS; do
    if [[ "$ablation" == full ]]; then
        run=sut_base; flag=()
    else
        run="sut_base-$ablation"; flag=(--ablation "$ablation")
    fi
    if [[ "$ablation" != full || ! -f "$CKPT/$run/checkpoint_last.pt" ]]; then
        "$PY" "$HERE/train.py" sut_base "${flag[@]}" --data "$PREP/data-bin" --ngpus "$NGPUS" \
            --max-tokens "$MAX_TOKENS" --save-dir "$CKPT/$run" "${DRY[@]}" "$@"
    fi
    "$PY" "$HERE/evaluate.py" --checkpoint-dir "$CKPT/$run" --data "$PREP/data-bin" \
        --prep-dir "$PREP" --name "$run" --table "$RESULTS" "${DRY[@]}"
    if [[ "${DRY_RUN:-0}" == 0 ]]; then
        grep -o "best_nll_loss [0-9.]*" "$CKPT/$run/train.log" | tail -1 | sed "s/^/$run valid /"
    fi
done
[[ "${DRY_RUN:-0}" != 0 ]] || cat "$RESULTS"
