"""``benchmarks/report.py``, ``make demo``'s report: its 2x rule on made-up tensors (so that a report passing
everything by mistake fails here), and the whole report on this machine: one row an op, case and kernel backend,
each passing, and an exit status that says so. On a CPU its kernels run under the interpreter at tiny shapes (about
10 s); on a GPU at the report's BERT / GPT sizes."""
from __future__ import annotations

import pytest
import torch

from utils import load_benchmark


@pytest.fixture(scope="module")
def report():
    yield from load_benchmark("report")


def test_report_errors_take_the_rule_tensor_by_tensor(report):
    hi = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    lo = [torch.tensor([0.0, 0.1, 0.0]), torch.tensor([0.0, 1.0])]
    ok, err, base = report._errors([torch.tensor([0.0, 0.15, 0.0]), torch.tensor([0.0, 1.2])], lo, hi)
    assert ok and (err, base) == pytest.approx((0.15, 0.1))  # (the worst by its allowance: 0.15 of 0.2, not 1.2 of 2.0)
    # the second tensor's error is the larger, but within its own allowance; the first one's is not
    ok, err, base = report._errors([torch.tensor([0.0, 0.3, 0.0]), torch.tensor([0.0, 1.2])], lo, hi)
    assert not ok and (err, base) == pytest.approx((0.3, 0.1))
    ok, _, _ = report._errors([torch.tensor([0.0, float("nan"), 0.0]), torch.tensor([0.0, 1.0])], lo, hi)
    assert not ok


def test_report_runs_and_every_row_passes(report, capsys):
    assert report.main() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if line.split(" ")[0] in ("attention", "layer_norm", "cross_entropy", "masked_lm_loss")]
    assert len(rows) == 6 * len(report._backends())
    assert all(" | pass " in row for row in rows), "\n".join(rows)
