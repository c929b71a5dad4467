"""``python -m sut_fairseq.selftest``: passes on a CPU machine, and its parity check fails
when the reference routed linear is wrong (forward or gradients)."""
import os
import subprocess
import sys

import pytest
import torch

from sut_fairseq import selftest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _fields(out: str) -> dict:
    """``label: text`` of the unindented lines."""
    return {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
            for line in out.splitlines() if ":" in line and not line.startswith(" ")}


def _parity_lines(out: str):
    return [line for line in out.splitlines()
            if line.startswith("  ") and line.rstrip().endswith(("PASS", "FAIL"))]


def test_selftest_passes_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("SUT_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "sut_fairseq.selftest"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    fields = _fields(out)
    assert fields["device"] == "CPU: no CUDA device"
    assert f"torch {torch.__version__}" in fields["versions"] and "fairseq " in fields["versions"]
    assert fields["expert path"].startswith("reference ")
    parity = _parity_lines(out)
    assert len(parity) == len(selftest.SHAPES) and all(l.endswith("PASS") for l in parity), out
    assert "GFLOP/s" in out and "needs a CUDA device" in out
    assert fields["result"].startswith("PASS")
    assert 8 <= len(out.splitlines()) <= 20, out


def _forward_off(reference):
    def broken(*args, **kwargs):
        return reference(*args, **kwargs) + 1e-2

    return broken


def _gradients_off(reference):
    def broken(*args, **kwargs):  # same values, every gradient 1% too large
        y = reference(*args, **kwargs)
        return y + 0.01 * (y - y.detach())

    return broken


@pytest.mark.parametrize("breakage", [_forward_off, _gradients_off], ids=["forward", "gradients"])
def test_selftest_fails_on_a_broken_reference(breakage, monkeypatch, capsys):
    monkeypatch.delenv("SUT_KERNELS", raising=False)
    monkeypatch.setattr(selftest, "reference_routed_linear", breakage(selftest.reference_routed_linear))
    assert selftest.main(["--device", "cpu", "--skip-speed"]) == 1
    out = capsys.readouterr().out
    parity = _parity_lines(out)
    assert len(parity) == len(selftest.SHAPES) and all(l.endswith("FAIL") for l in parity), out
    assert _fields(out)["result"].startswith("FAIL")


def test_selftest_help():
    with pytest.raises(SystemExit) as exit_info:
        selftest.main(["--help"])
    assert exit_info.value.code == 0


def test_loop_is_the_definition():
    """The per-slot loop (the CPU oracle) on a hand-checked case: two tokens, k = 2,
    token 1's second slot halted; gated sum and slot rows."""
    from sut_fairseq.ops.routing import make_routing

    idx = torch.tensor([[1, 0], [0, 2]])  # E = 2: slot 3 is a no-op
    gates = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    routing = make_routing(idx, gates, 2)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.stack([torch.eye(2), 2 * torch.eye(2)])
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    slots = selftest.loop_routed_linear(x, w, b, routing, fan_out=2)
    torch.testing.assert_close(slots, torch.tensor([[3.0, 4.0], [1.0, 3.0], [3.0, 5.0], [0.0, 0.0]]))
    mixed = selftest.loop_routed_linear(x, w, b, routing, fan_out=2, gates=gates)
    torch.testing.assert_close(mixed, torch.tensor([[1.5, 3.25], [3.0, 5.0]]))
    ref = selftest.reference_routed_linear
    torch.testing.assert_close(ref(x, w, b, routing, fan_out=2), slots)
    torch.testing.assert_close(ref(x, w, b, routing, fan_out=2, gates=gates), mixed)
