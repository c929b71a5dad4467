#!/bin/sh
# Staged GPU validation: scripts/gpu/validate.sh STAGE OUT [--smoke]
# (STAGE: tests, bench, logic-sut, logic-baselines, cpvr; see docs/gpu.md and validate.py).
# A thin wrapper: validate.py uses the standard library only, so any python3 runs it; it
# finds (or installs) the Python with torch, fairseq and sut_fairseq for the steps itself.
here=$(cd "$(dirname "$0")" && pwd)
for py in "${VALIDATE_PYTHON:-}" python3 python; do
    if [ -n "$py" ] && command -v "$py" >/dev/null 2>&1; then
        exec "$py" "$here/validate.py" "$@"
    fi
done
echo "validate.sh: no python3 on PATH (set VALIDATE_PYTHON)" >&2
exit 2
