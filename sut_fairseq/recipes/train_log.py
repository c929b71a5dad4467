"""What a fairseq-train log says: the parameter count, the last update, why training
stopped and the best value of a validation metric."""
import re
from typing import Dict, Optional

_PARAMS = re.compile(r"num\. (shared|expert) model params: ([\d,]+)")
_UPDATES = re.compile(r"num_updates[ =](\d+)")


def parse_train_log(path: str) -> Dict:
    """``{"params", "updates", "stop_reason"}``: parameters (shared + expert, as
    fairseq-train logs them; None when not logged), the last update number and the reason
    fairseq gave for stopping (None when it did not say)."""
    params, updates, stop = {}, None, None
    with open(path, errors="replace") as log:
        for line in log:
            for kind, value in _PARAMS.findall(line):
                params[kind] = int(value.replace(",", ""))
            for value in _UPDATES.findall(line):
                updates = int(value)
            if "Stopping training due to" in line:
                stop = line.split("Stopping training due to", 1)[1].strip()
    return {"params": sum(params.values()) if params else None, "updates": updates,
            "stop_reason": stop}


def best_valid(path: str, metric: str, maximize: bool = True,
               subset: str = "valid") -> Optional[float]:
    """The best ``metric`` over the validations of ``subset`` in the log (the value
    checkpoint_best.pt was saved at when it is the checkpoint metric), or None."""
    pattern = re.compile(r"\| " + re.escape(metric) + r" (-?[\d.]+)")
    best = None
    with open(path, errors="replace") as log:
        for line in log:
            if f"valid on '{subset}' subset" in line:
                match = pattern.search(line)
                if match:
                    value = float(match.group(1))
                    if best is None or (value > best if maximize else value < best):
                        best = value
    return best
