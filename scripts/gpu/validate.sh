#!/bin/sh
# Staged GPU validation: scripts/gpu/validate.sh STAGE OUT [--smoke] [options]
# (STAGE: tests, tests-train, bench, logic-sut, logic-baselines, cpvr; options: the node's
# limits, --help lists them; see docs/gpu.md). A thin wrapper: validate.py and the gpu_*.py
# modules beside it use the standard library only, so any python3 runs them; they find
# (or install) the Python with torch, fairseq and sut_fairseq for the steps themselves.
here=$(cd "$(dirname "$0")" && pwd)
for py in "${VALIDATE_PYTHON:-}" python3 python; do
    if [ -n "$py" ] && command -v "$py" >/dev/null 2>&1; then
        exec "$py" "$here/validate.py" "$@"
    fi
done
echo "validate.sh: no python3 on PATH (set VALIDATE_PYTHON)" >&2
exit 2
