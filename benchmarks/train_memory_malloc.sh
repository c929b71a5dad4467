#!/usr/bin/env bash
# Peak memory of the UT's Multi30k training under glibc's malloc settings
# (docs/results/multi30k.md, "Diagnosis" (4)): UPDATES updates of ut_multi30k, one thread,
# no validation or checkpoints, two runs at a time (cores 0 and 1); GNU time's maximum
# RSS of each run is appended to OUT/memprobe.txt.
#
#   benchmarks/train_memory_malloc.sh DATA_BIN OUT [UPDATES]     # DATA_BIN: prepare.py's data-bin
set -euo pipefail
DATA=${1:?usage: train_memory_malloc.sh DATA_BIN OUT [UPDATES]}
OUT=${2:?usage: train_memory_malloc.sh DATA_BIN OUT [UPDATES]}
UPDATES=${3:-40}
PYTHON=${PYTHON:-python}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
USER_DIR="$(dirname "$HERE")/sut_fairseq"
mkdir -p "$OUT"

run() {  # NAME CORE [VAR=VALUE ...]
  local name=$1 core=$2; shift 2
  echo "+ $name on core $core: ${*:-glibc defaults}"
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$@" taskset -c "$core" \
    /usr/bin/time -f "$name maxrss_kb %M wall_s %e" -o "$OUT/$name.time" \
    "$PYTHON" -m fairseq_cli.train "$DATA" --user-dir "$USER_DIR" --task translation \
    --source-lang en --target-lang de --share-all-embeddings --optimizer adam \
    --adam-betas '(0.9, 0.98)' --weight-decay 0.0001 --clip-norm 1.0 --lr 1e-3 \
    --lr-scheduler inverse_sqrt --warmup-updates 500 --label-smoothing 0.1 --max-tokens 4096 \
    --required-batch-size-multiple 1 --disable-validation --no-save --log-format simple \
    --log-interval 10 --num-workers 0 --max-update "$UPDATES" --arch ut_multi30k \
    --criterion sut_label_smoothed_cross_entropy --act-weight 1 --aux-loss-scale reference \
    --seed 1 > "$OUT/$name.log" 2>&1
  cat "$OUT/$name.time" >> "$OUT/memprobe.txt"
}

run default 0 & run arena2 1 MALLOC_ARENA_MAX=2 & wait
run mmap64k 0 MALLOC_MMAP_THRESHOLD_=65536 & run mmap1m-trim 1 MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=0 & wait
cat "$OUT/memprobe.txt"
