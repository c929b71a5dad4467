#!/usr/bin/env bash
# Paper Table 4 on CFQ from scratch: prepare + binarize the splits (once), then train and
# evaluate UT w/o halting and UT with halting, 5 seeds each, and print the table.
#
#   scripts/cfq/table4.sh                        # downloads cfq1.1.tar.gz into $DATA/download
#   ARCHIVE=~/cfq1.1.tar.gz scripts/cfq/table4.sh
#   CFQ_DIR=~/cfq scripts/cfq/table4.sh          # the extracted archive
#   DRY_RUN=1 scripts/cfq/table4.sh              # print every command, run nothing
#   SMOKE=1 CFQ_DIR=tests/fixtures/cfq SPLITS="mcd1 random_split" SEEDS=1 scripts/cfq/table4.sh   # CPU
#
# Variables: DATA (data/cfq), WORK (runs/cfq), SPLITS ("mcd1 mcd2 mcd3 random_split"),
# VARIANTS ("no-halting halting"), SEEDS ("1 2 3 4 5"), PYTHON (python), TRAIN_ARGS (extra
# fairseq-train arguments, e.g. "--fp16"). Arguments after the variables go to table4.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python}"
DATA="${DATA:-data/cfq}"
WORK="${WORK:-runs/cfq}"
read -r -a SPLITS <<< "${SPLITS:-mcd1 mcd2 mcd3 random_split}"
read -r -a VARIANTS <<< "${VARIANTS:-no-halting halting}"
read -r -a SEEDS <<< "${SEEDS:-1 2 3 4 5}"

SOURCE=()
if [ -n "${CFQ_DIR:-}" ]; then SOURCE=(--cfq-dir "$CFQ_DIR"); fi
if [ -n "${ARCHIVE:-}" ]; then SOURCE=(--archive "$ARCHIVE"); fi
OPTIONS=()
if [ -n "${SMOKE:-}" ]; then OPTIONS+=(--smoke); fi
if [ -n "${DRY_RUN:-}" ]; then OPTIONS+=(--dry-run); fi
if [ -n "${TRAIN_ARGS:-}" ]; then OPTIONS+=(--train-args "$TRAIN_ARGS"); fi

MISSING=()
for split in "${SPLITS[@]}"; do
  [ -f "$DATA/$split/bin/dict.src.txt" ] || MISSING+=("$split")
done
if [ "${#MISSING[@]}" -gt 0 ]; then
  PREPARE=("$PY" "$REPO/data-prep/cfq/prepare.py" "${SOURCE[@]}" --out "$DATA"
           --split "${MISSING[@]}" --binarize --overwrite)
  echo "+ ${PREPARE[*]}"
  [ -n "${DRY_RUN:-}" ] || "${PREPARE[@]}"
fi

RUN=("$PY" "$HERE/table4.py" --data "$DATA" --work-dir "$WORK" --splits "${SPLITS[@]}"
     --variants "${VARIANTS[@]}" --seeds "${SEEDS[@]}" "${OPTIONS[@]}" "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
