"""Early-exit part of the threshold sweep: decoding at each PABEE patience P and each
entropy threshold S, and one figure with three trade-off curves.

``python -m sut_fairseq.analysis.sweep ... --patience 0,1,2,3,5 --entropy 0.01,0.1,0.5
[--exit-path CKPT]`` decodes the test set with the stock ``fairseq-generate`` once per
value, overriding the decoder's rule and its parameter::

    --model-overrides "{'decoder_halting': 'pabee', 'exit_patience': P}"
    --model-overrides "{'decoder_halting': 'entropy', 'exit_entropy': S}"

(both rules share the off-ramps, so one checkpoint trained with either serves both). The
fraction of decoder steps executed comes from fairseq-generate's closing line, as for the
α_thresh rows. ``exits.png`` then draws the task metric against the decoder steps executed
while decoding for the three knobs: α_thresh (the rows of ``--path``), P and S (the rows
of ``--exit-path``, default ``--path``). P = 0 and S = 0 mean "never exit" and mark full
depth. ``exits.csv`` holds the P and S rows.
"""
from typing import Dict, List, Optional, Sequence

from ..modules.exits import check_entropy, check_patience

EXIT_COLUMNS = ("rule", "value", "metric", "metric_name", "sentences",
                "decode_executed_encoder", "decode_executed_decoder")


def parse_patience(text: str) -> List[int]:
    """"0,1,2" -> [0, 1, 2]; each an integer >= 0 (0 = never exit)."""
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--patience: {part!r} is not an integer") from None
        check_patience(value)
        values.append(value)
    return sorted(set(values))


def parse_entropy(text: str) -> List[float]:
    """"0.01,0.5" -> [0.01, 0.5]; each a finite number >= 0 in nats (0 = never exit)."""
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--entropy: {part!r} is not a number") from None
        check_entropy(value)
        values.append(value)
    return sorted(set(values))


def exit_overrides(rule: str, value) -> str:
    """The ``--model-overrides`` dictionary that sets the rule and its parameter."""
    if rule == "pabee":
        return f"{{'decoder_halting': 'pabee', 'exit_patience': {int(value)}}}"
    if rule == "entropy":
        return f"{{'decoder_halting': 'entropy', 'exit_entropy': {float(value)!r}}}"
    raise ValueError(f"unknown exit rule {rule!r}")


def with_overrides(command: List[str], overrides: str) -> List[str]:
    """``command`` with the value after ``--model-overrides`` replaced."""
    command = list(command)
    i = command.index("--model-overrides")
    command[i + 1] = overrides
    return command


def require_offramps(model, path: str) -> None:
    from ..modules.exits import ExitHalting

    if not isinstance(getattr(getattr(model.decoder, "side", None), "halting", None), ExitHalting):
        raise SystemExit(f"error: --patience / --entropy need a checkpoint with off-ramps "
                         f"(trained with --decoder-halting pabee or entropy); {path} has none "
                         "(pass one with --exit-path)")


def sweep_exits(base_command: List[str], patience: Sequence[int], entropy: Sequence[float],
                metric: str, output_dir: str, run_generate, score, read_generate_output) -> List[Dict]:
    """Decode once per P and per S; ``base_command`` is the fairseq-generate command of
    the exit checkpoint (its ``--model-overrides`` value is replaced). Returns the rows."""
    import os
    import time

    rows = []
    for rule, values in (("pabee", patience), ("entropy", entropy)):
        for value in values:
            start = time.time()
            out = os.path.join(output_dir, f"generate-{rule}-{value:g}.txt")
            executed = run_generate(with_overrides(base_command, exit_overrides(rule, value)), out)
            examples = read_generate_output(out)
            row = {"rule": rule, "value": value, "metric": score(examples, metric), "metric_name": metric,
                   "sentences": len(examples), "decode_executed_encoder": executed.get("encoder"),
                   "decode_executed_decoder": executed.get("decoder")}
            rows.append(row)
            name = "P" if rule == "pabee" else "S"
            dec = row["decode_executed_decoder"]
            print(f"{rule} {name} = {value:g}: decoder steps executed "
                  f"{'–' if dec is None else f'{100 * dec:.1f}%'}, {metric} {row['metric']:.2f} "
                  f"({time.time() - start:.0f} s)", flush=True)
    return rows


def format_exit_table(rows: List[Dict], metric: str) -> str:
    lines = [f"| rule | value | decoder steps executed | {metric} |", "|---|---|---|---|"]
    for r in rows:
        name = "P" if r["rule"] == "pabee" else "S"
        never = " (never exits)" if r["value"] == 0 else ""
        dec = r.get("decode_executed_decoder")
        lines.append(f"| {r['rule']} | {name} = {r['value']:g}{never} | "
                     f"{'–' if dec is None else f'{100 * dec:.1f}%'} | {r['metric']:.2f} |")
    return "\n".join(lines)


def exits_figure(threshold_rows: List[Dict], exit_rows: List[Dict], metric_label: str, path: str,
                 title: str = "", threshold_label: Optional[str] = None) -> None:
    """One PNG: ``metric_label`` against the decoder steps executed while decoding (%),
    one curve per knob (α_thresh, PABEE P, entropy S), each point labelled with its
    value. Rows without a decoder fraction are left out."""
    from .plots import _pyplot, savefig_atomic

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.0), layout="constrained")
    curves = [(threshold_label or r"stick-breaking $\alpha_{thresh}$", "threshold",
               list(threshold_rows), "o-", "tab:blue"),
              ("PABEE patience P", "value", [r for r in exit_rows if r["rule"] == "pabee"], "s-", "tab:orange"),
              ("entropy S (nats)", "value", [r for r in exit_rows if r["rule"] == "entropy"], "^-", "tab:green")]
    for label, key, rows, style, color in curves:
        rows = [r for r in rows if r.get("decode_executed_decoder") is not None]
        if not rows:
            continue
        rows = sorted(rows, key=lambda r: r["decode_executed_decoder"])
        xs = [100 * r["decode_executed_decoder"] for r in rows]
        ys = [r["metric"] for r in rows]
        ax.plot(xs, ys, style, color=color, label=label, alpha=0.85)
        for i, (x, y, r) in enumerate(zip(xs, ys, rows)):
            ax.annotate(f"{r[key]:g}", (x, y), textcoords="offset points", color=color,
                        xytext=(4, 5 if i % 2 else -11), fontsize=8)
    ax.set_xlabel("decoder steps executed while decoding (% of L × target positions)")
    ax.set_ylabel(metric_label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "early exits and halting: decoder compute vs quality", fontsize=10)
    savefig_atomic(fig, path)
    plt.close(fig)
