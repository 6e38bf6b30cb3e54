"""``benchmarks/attention.py``'s varlen goal ratio (each packed varlen row's time over cuDNN's on the sequences padded)
must take cuDNN's row by name: with the C++ build the rows are Triton's varlen, the C++ varlen, then cuDNN's, and the
old rows[1] compared the Triton row with the C++ one (run199-234). CPU only: rows with known times."""
from __future__ import annotations

import pytest

from utils import load_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from load_benchmark("attention")


def _row(impl, fwd, bwd, gfwd=None, gbwd=None, status="ok"):
    row = {"impl": impl, "status": status, "fwd_ms": fwd, "bwd_ms": bwd}
    if gfwd is not None:
        row.update(graph_fwd_ms=gfwd, graph_bwd_ms=gbwd)
    return row


def test_varlen_ratio_is_against_cudnn_whatever_the_row_order(bench):
    rows = [_row("pykernels varlen (packed)", 0.2, 0.3, 0.1, 0.2),
            _row("pykernels cuda varlen (packed)", 0.3, 0.6, 0.12, 0.24),
            _row("sdpa cudnn (padded)", 0.3, 0.6, 0.15, 0.3),
            _row("pykernels triton (padded)", 0.25, 0.5, 0.13, 0.26)]
    bench.varlen_ratios(rows)
    triton, cuda, cudnn, padded = rows
    assert triton["time_vs_cudnn_padded"] == pytest.approx(0.5 / 0.9, abs=1e-3)
    assert triton["goal_le_0.667"] == "met"
    assert triton["graph_time_vs_cudnn_padded"] == pytest.approx(0.3 / 0.45, abs=1e-3)
    assert cuda["time_vs_cudnn_padded"] == pytest.approx(1.0, abs=1e-3)
    assert cuda["goal_le_0.667"] == "not met"
    assert cuda["graph_time_vs_cudnn_padded"] == pytest.approx(0.36 / 0.45, abs=1e-3)
    assert "time_vs_cudnn_padded" not in cudnn and "time_vs_cudnn_padded" not in padded
    # the C++ row absent (a build without the extension) or listed first: the same answers for Triton's row
    for order in ([rows[0], rows[2]], [rows[1], rows[0], rows[2]]):
        fresh = [{k: v for k, v in r.items() if "vs_cudnn" not in k and "goal" not in k} for r in order]
        bench.varlen_ratios(fresh)
        t = next(r for r in fresh if r["impl"] == "pykernels varlen (packed)")
        assert t["graph_time_vs_cudnn_padded"] == pytest.approx(0.3 / 0.45, abs=1e-3)


def test_varlen_ratio_skips_rows_that_did_not_run(bench):
    rows = [_row("pykernels varlen (packed)", 0.2, 0.4, status="INVALID"),
            _row("sdpa cudnn (padded)", 0.3, 0.6, 0.15, 0.3)]
    bench.varlen_ratios(rows)
    assert "time_vs_cudnn_padded" not in rows[0]
    rows = [_row("pykernels varlen (packed)", 0.2, 0.4, 0.1, 0.2), _row("sdpa cudnn (padded)", 0.3, 0.6,
                                                                           status="error: no kernel")]
    bench.varlen_ratios(rows)
    assert "time_vs_cudnn_padded" not in rows[0]
    # no graph times: the do_bench ratio alone
    rows = [_row("pykernels varlen (packed)", 0.2, 0.5), _row("sdpa cudnn (padded)", 0.3, 0.6)]
    bench.varlen_ratios(rows)
    assert rows[0]["time_vs_cudnn_padded"] == pytest.approx(0.7 / 0.9, abs=1e-3)
    assert rows[0]["goal_le_0.667"] == "not met"
    assert "graph_time_vs_cudnn_padded" not in rows[0]


def test_matrix_smoke_validates_gqa_and_odd_head_dims(bench, monkeypatch):
    """``--matrix`` (the shapes beyond the anchors) on CPU: every pykernels row (Triton and auto) of a D = 80 case and
    a GQA case (4 query heads over 2 key / value heads) passes the three-way check against the fp32 reference and
    torch's SDPA, which the peers' rows get ``enable_gqa`` for; the labels name the key / value heads."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("--smoke is the CPU plumbing check")
    seen: list[dict] = []
    monkeypatch.setattr(bench.common, "print_table", lambda rows, cols: seen.extend(rows))
    assert bench.main(["--smoke", "--matrix"]) == 0
    ours = [r for r in seen if r["impl"].startswith("pykernels")]
    assert {r["shape"] for r in ours} == {"B2 H2 S24 D80 bidirectional", "B2 H4/2 S20 D16 causal"}
    assert {r["impl"] for r in ours} >= {"pykernels triton", "pykernels auto"}
    for r in ours:
        assert r["status"] == "ok", r
        assert float(r["err_out"]) < 1e-4 and float(r["err_dq"]) < 1e-4, r
    gqa = [r for r in seen if r["shape"] == "B2 H4/2 S20 D16 causal" and r["impl"] == "sdpa flash"]
    assert gqa and gqa[0]["status"] == "ok" and gqa[0]["Hkv"] == 2


def test_matrix_only_runs_the_named_cases(bench, monkeypatch):
    """``--matrix --only NAMES`` runs those MATRIX cases alone; a name the matrix lacks is refused, naming the cases."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("--smoke is the CPU plumbing check")
    seen: list[dict] = []
    monkeypatch.setattr(bench.common, "print_table", lambda rows, cols: seen.extend(rows))
    assert bench.main(["--smoke", "--matrix", "--only", "gqa"]) == 0
    assert {r["shape"] for r in seen if r["impl"].startswith("pykernels")} == {"B2 H4/2 S20 D16 causal"}
    with pytest.raises(SystemExit, match="no MATRIX case named d999.*have d80, gqa"):
        bench.main(["--smoke", "--matrix", "--only", "gqa,d999"])


@pytest.mark.parametrize("d,tile", [(96, 128), (80, 128), (192, 256), (128, 128), (256, 256)])
def test_tuned_configs_names_the_gluon_tiles_of_padded_head_dims(bench, monkeypatch, d, tile):
    """The matrix's configs column at head dims the Gluon kernels run on wider tiles (``attention_sm90.TILE_D``): the
    tiles' own configs (run487's "pykernels triton" rows failed there with a KeyError on D = 80 / 96). The Gluon
    rules' answers stubbed (what the GPU gives them)."""
    pytest.importorskip("triton.experimental.gluon")
    from pykernels._kernels import attention_sm90 as a9
    from pykernels._kernels import attention_sm90_bwd as kb
    assert bench._tile_d(d) == tile
    monkeypatch.setattr(bench, "sm90_case", lambda *a: True)
    for which in ("fused", "dkdv") if d <= 128 else ("dkdv",):  # (what ``sm90_backward`` answers at these dims)
        monkeypatch.setattr(bench, "sm90_bwd_kernels", lambda *a, _w=which: _w)
        got = bench.tuned_configs(d, 2048, False, 0)
        bm, bn, st = a9.CONFIGS[d]
        assert got.startswith(f"fwd gluon ping-pong 2x{bm}x{bn}/s{st} persistent"), got
        assert (f"on {tile}-wide tiles" in got) == (tile != d), got
        fwd, bwd = got.split("; ", 1)
        assert ("GEMMs on columns 128+64" in fwd) == (d == 192 and a9.SPLIT_D), got  # (the forward's column split)
        assert ("GEMMs on columns 128+64" in bwd) == (d == 192 and kb.SPLIT_D_BWD), got  # (the backward's)
        if which == "fused" and d <= 128:
            assert "dkdv gluon fused ws 2x{} keys".format(kb.DKDV_CONFIGS[tile][0]) in got, got
