#!/usr/bin/env bash
# Paper Table 4 on CFQ from scratch with environment variables instead of options: the
# same as scripts/cfq/table4.py (stages data -> train -> evaluate -> report).
#
#   scripts/cfq/table4.sh                        # downloads cfq1.1.tar.gz into $DATA/download
#   ARCHIVE=~/cfq1.1.tar.gz scripts/cfq/table4.sh
#   CFQ_DIR=~/cfq scripts/cfq/table4.sh          # the extracted archive
#   DRY_RUN=1 scripts/cfq/table4.sh              # print every command, run nothing
#   SMOKE=1 CFQ_DIR=tests/fixtures/cfq SPLITS="mcd1 random_split" SEEDS=1 scripts/cfq/table4.sh   # CPU
#
# Variables: DATA (data/cfq), WORK (runs/cfq), SPLITS ("mcd1 mcd2 mcd3 random_split"),
# VARIANTS ("no-halting halting"), SEEDS ("1 2 3 4 5"), PYTHON (python), TRAIN_ARGS (extra
# fairseq-train arguments, e.g. "--fp16"). Arguments after the variables go to table4.py
# (e.g. --stage evaluate).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
read -r -a SPLITS <<< "${SPLITS:-mcd1 mcd2 mcd3 random_split}"
read -r -a VARIANTS <<< "${VARIANTS:-no-halting halting}"
read -r -a SEEDS <<< "${SEEDS:-1 2 3 4 5}"
OPTIONS=()
if [ -n "${CFQ_DIR:-}" ]; then OPTIONS+=(--cfq-dir "$CFQ_DIR"); fi
if [ -n "${ARCHIVE:-}" ]; then OPTIONS+=(--archive "$ARCHIVE"); fi
if [ -n "${SMOKE:-}" ]; then OPTIONS+=(--smoke); fi
if [ -n "${DRY_RUN:-}" ]; then OPTIONS+=(--dry-run); fi
if [ -n "${TRAIN_ARGS:-}" ]; then OPTIONS+=(--train-args "$TRAIN_ARGS"); fi
RUN=("${PYTHON:-python}" "$HERE/table4.py" --data "${DATA:-data/cfq}" --work-dir "${WORK:-runs/cfq}"
     --splits "${SPLITS[@]}" --variants "${VARIANTS[@]}" --seeds "${SEEDS[@]}" "${OPTIONS[@]}" "$@")
echo "+ ${RUN[*]}"
exec "${RUN[@]}"
