"""What a fairseq-train log says: the parameter count, the last update, why training
stopped and the best value of a validation metric."""
import re
import statistics
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


_INNER = re.compile(r"\| train_inner \|.*?ups=([\d.]+),.*?num_updates=(\d+)")


def training_hours(path: str) -> Optional[float]:
    """Hours of training the log records, from fairseq's update rate of each logged
    interval:  Σ_i (N_i − N_{i−1}) / ups_i / 3600  over the ``train_inner`` lines' update
    numbers N_i (N_0 = 0). A resumed run logs an interval again: its last record counts (the
    updates redone after a restart are counted once, at the rate of the run that kept
    them); updates after the last record (up to the log's last update number) at its rate.
    The rate is fairseq's wall-clock one, so the validations inside an interval count; an
    interval slower than a quarter of the run's median rate is a process that was
    suspended or starved (a validation slows an interval about twofold), and counts at the
    median rate. None when the log has no such line."""
    rates: Dict[int, float] = {}
    with open(path, errors="replace") as log:
        for line in log:
            match = _INNER.search(line)
            if match and float(match.group(1)) > 0:
                rates[int(match.group(2))] = float(match.group(1))
    if not rates:
        return None
    median = statistics.median(rates.values())
    rate = {n: r if r >= median / 4 else median for n, r in rates.items()}
    seconds, previous = 0.0, 0
    for updates in sorted(rate):
        seconds += (updates - previous) / rate[updates]
        previous = updates
    last = parse_train_log(path)["updates"] or previous
    seconds += max(0, last - previous) / rate[previous]
    return seconds / 3600
