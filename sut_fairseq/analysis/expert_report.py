"""Expert–token co-occurrence (paper Table 3): the top tokens of every expert of every
router, over all steps, from a teacher-forced pass over a data split.

    python -m sut_fairseq.analysis.expert_report --path CKPT --data DATA_BIN [--gen-subset test]
        [--threshold T] [--top 5] [--score pmi|p_token_given_expert|count]
        [--min-count 10] [--max-sentences N] [--decoder-token input|target] [--json out.json]

Forward hooks on the routers (encoder self-attention, encoder FFD, decoder
self-attention, cross-attention and FFD) see every routing decision of the pass: row r of
a router call is position r of the flattened (batch × length) side, so each (position,
step) row the router sent to experts is mapped back to its token id — the source token
in the encoder; in the decoder the token at that position of the decoder input (the
previous target token) or, with ``--decoder-token target``, the target token it predicts.
Halted and padding rows go to no expert and are not counted. Each routed row counts once
for each of its k selected experts (gates are not used as weights).

Scores, from the counts n(e, t) of expert e with token t (N = Σ n over the router):

* ``pmi`` (default): ``log [P(e, t) / (P(e) P(t))]`` with the marginals of the same table —
  how much more often than chance the token goes to this expert, so frequent tokens do
  not top every expert; tokens with fewer than ``--min-count`` routed rows are skipped;
* ``p_token_given_expert``: ``n(e, t) / n(e)`` — raw share, dominated by frequent tokens;
* ``count``: n(e, t).
"""
import argparse
import math
import sys
from typing import Dict, List, Optional

import torch

SCORES = ("pmi", "p_token_given_expert", "count")


def routers(model) -> Dict[str, object]:
    """name -> Router for every routed layer with more than one expert (a hyper-module
    sub-layer of Hyper-UT routes no tokens and has none)."""
    found = {}
    for side_name, side in (("encoder", model.encoder.side), ("decoder", model.decoder.side)):
        block = side.block
        for layer_name, layer in (("self-attn", block.self_attn), ("cross-attn", block.cross_attn),
                                  ("FFD", block.ffd)):
            router = getattr(layer, "router", None)
            if router is not None and router.num_experts > 1:
                found[f"{side_name} {layer_name}"] = router
    return found


class CoOccurrence:
    """Counts n(e, t) per router while attached (forward hooks on the routers)."""

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self.routers = routers(model)
        self.counts = {name: torch.zeros(r.num_experts, vocab_size, dtype=torch.long)
                       for name, r in self.routers.items()}
        self.tokens: Dict[str, torch.Tensor] = {}  # side -> (B*T,) token ids of this forward
        self.handles = []

    def __enter__(self):
        for name, router in self.routers.items():
            self.handles.append(router.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name: str):
        side = name.split()[0]

        def hook(router, inputs, routing):
            tokens = self.tokens[side]
            if routing.num_tokens != tokens.numel():
                raise RuntimeError(f"{name}: router saw {routing.num_tokens} rows for "
                                   f"{tokens.numel()} positions (incremental decoding is not supported)")
            E = router.num_experts
            idx = routing.expert_idxs.cpu()  # (N, k); E = no-op (halted / padding)
            tok = tokens.cpu().unsqueeze(1).expand_as(idx)
            keep = idx < E
            flat = idx[keep] * self.vocab_size + tok[keep]
            self.counts[name] += torch.bincount(flat, minlength=E * self.vocab_size).view(E, self.vocab_size)

        return hook


@torch.no_grad()
def collect(model, task, subset: str, threshold: Optional[float] = None,
            max_sentences: Optional[int] = None, batch_size: int = 64,
            decoder_token: str = "input") -> CoOccurrence:
    """Teacher-forced pass over ``subset`` recording n(e, t) for every router."""
    if decoder_token not in ("input", "target"):
        raise ValueError(f"decoder_token must be 'input' or 'target'; got {decoder_token!r}")
    if threshold is not None:
        model.set_halting_threshold(threshold)
    model.eval()
    vocab = max(len(task.source_dictionary), len(task.target_dictionary))
    itr = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=batch_size,
                                  required_batch_size_multiple=1, seed=1,
                                  ignore_invalid_inputs=False).next_epoch_itr(shuffle=False)
    seen = 0
    with CoOccurrence(model, vocab) as co:
        for sample in itr:
            if not sample:
                continue
            net_input = sample["net_input"]
            if max_sentences is not None and seen + len(sample["id"]) > max_sentences:
                keep = max_sentences - seen
                net_input = {k: v[:keep] for k, v in net_input.items()}
                sample = {**sample, "target": sample["target"][:keep], "id": sample["id"][:keep]}
            co.tokens["encoder"] = net_input["src_tokens"].reshape(-1)
            dec = net_input["prev_output_tokens"] if decoder_token == "input" else sample["target"]
            co.tokens["decoder"] = dec.reshape(-1)
            model(net_input["src_tokens"], net_input["src_lengths"], net_input["prev_output_tokens"])
            seen += len(sample["id"])
            if max_sentences is not None and seen >= max_sentences:
                break
    co.sentences = seen
    return co


def top_tokens(counts: torch.Tensor, dictionary, top: int = 5, score: str = "pmi",
               min_count: int = 10) -> List[Dict]:
    """Per expert: its share of the router's picks and its ``top`` tokens by ``score``."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; choose from {SCORES}")
    n = counts.double()
    total = n.sum().item()
    per_expert = n.sum(1)
    per_token = n.sum(0)
    if score == "pmi":
        expected = per_expert.unsqueeze(1) * per_token.unsqueeze(0) / max(total, 1.0)
        values = torch.log(n / expected.clamp_min(1e-12))
        values[(n == 0) | (per_token < min_count).unsqueeze(0).expand_as(n)] = -math.inf
    elif score == "p_token_given_expert":
        values = n / per_expert.clamp_min(1).unsqueeze(1)
        values[n == 0] = -math.inf
    else:
        values = n.clone()
        values[n == 0] = -math.inf
    report = []
    for e in range(counts.size(0)):
        k = min(top, int(torch.isfinite(values[e]).sum()))
        best = values[e].topk(k) if k else None
        tokens = [] if best is None else [
            {"token": dictionary[t], "id": t, "count": int(counts[e, t]), "score": float(v)}
            for v, t in zip(best.values.tolist(), best.indices.tolist())]
        report.append({"expert": e, "rows": int(per_expert[e]),
                       "share": per_expert[e].item() / total if total else 0.0, "top": tokens})
    return report


def build_report(co: CoOccurrence, src_dict, tgt_dict, top: int = 5, score: str = "pmi",
                 min_count: int = 10) -> Dict:
    """router name -> its experts' shares and top tokens (source dictionary for the
    encoder's routers, target dictionary for the decoder's)."""
    return {name: {"num_experts": counts.size(0), "top_k": co.routers[name].top_k,
                   "picks": int(counts.sum()),
                   "experts": top_tokens(counts, src_dict if name.startswith("encoder") else tgt_dict,
                                         top, score, min_count)}
            for name, counts in co.counts.items()}


def _escape(token: str) -> str:
    return token.replace("|", "\\|").replace("`", "'")


def format_markdown(report: Dict, score: str, min_count: int) -> str:
    explain = {"pmi": f"PMI = log P(e,t) / (P(e) P(t)); tokens with < {min_count} routed rows skipped",
               "p_token_given_expert": "P(token | expert) = n(e,t) / n(e)",
               "count": "n(e,t), routed rows of token t sent to expert e"}[score]
    out = []
    for name, r in report.items():
        out.append(f"### {name} (E = {r['num_experts']}, k = {r['top_k']}; {r['picks']:,} expert picks "
                   f"over all steps)\n\nscore: {explain}\n")
        out.append("| expert | share of picks | top tokens (score, count) |\n|---|---|---|")
        for e in r["experts"]:
            tops = ", ".join(f"`{_escape(t['token'])}` ({t['score']:.2f}, {t['count']})" for t in e["top"]) or "–"
            out.append(f"| {e['expert']} | {100 * e['share']:.1f}% | {tops} |")
        out.append("")
    if not report:
        out.append("no routed layer with more than one expert (a dense UT has nothing to report)")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="checkpoint")
    parser.add_argument("--data", required=True, help="fairseq data-bin directory")
    parser.add_argument("--gen-subset", default="test")
    parser.add_argument("--threshold", type=float, default=None,
                        help="α_thresh of the pass (default: the checkpoint's)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--score", choices=SCORES, default="pmi")
    parser.add_argument("--min-count", type=int, default=10, help="PMI: skip rarer tokens")
    parser.add_argument("--max-sentences", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--decoder-token", choices=["input", "target"], default="input",
                        help="decoder rows: the input token at the position, or the token it predicts")
    parser.add_argument("--json", default=None, help="also write the report as JSON")
    args = parser.parse_args(argv)
    from .halting_analysis import load

    model, task = load(args.data, args.path, args.threshold, args.gen_subset)
    if not hasattr(model.encoder, "side"):
        raise SystemExit("error: the expert report needs a sut_transformer checkpoint")
    if not routers(model):
        raise SystemExit(f"error: {args.path} has no layer with more than one expert (a dense "
                         "UT or a Hyper-UT, whose hyper-modules route no tokens): nothing to report")
    co = collect(model, task, args.gen_subset, args.threshold, args.max_sentences, args.batch_size,
                 args.decoder_token)
    report = build_report(co, task.source_dictionary, task.target_dictionary, args.top, args.score,
                          args.min_count)
    print(f"{args.path}: {co.sentences} sentence pairs of {args.gen_subset}, teacher-forced, "
          f"α_thresh {model.encoder.side.halting.threshold}\n")
    print(format_markdown(report, args.score, args.min_count))
    if args.json:
        from ..data.atomic import write_json_atomic

        write_json_atomic(args.json, {"checkpoint": args.path, "subset": args.gen_subset,
                                      "sentences": co.sentences, "score": args.score,
                                      "min_count": args.min_count, "decoder_token": args.decoder_token,
                                      "routers": report})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
