"""Smoke tests of `stagewise bench kernels` (toy sizes, few repeats; no timing assertions),
and the attention baselines (vectorised, SDPA, FlexAttention over the paged cache) against the
reference."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from helpers.kernels import TOLERANCES, paged_kv

import stagewise.ops
from stagewise.bench import report
from stagewise.bench.cli import main
from stagewise.bench.kernels import attention_baselines as ab
from stagewise.bench.kernels import cases
from stagewise.bench.kernels import report as table
from stagewise.cli import main as cli_main
from stagewise.ops import reference as ref

FAST = ["--tiny", "--repeats", "2", "--warmup", "1", "--device", "cpu"]


def _run(tmp_path, *extra, entry=main) -> dict:
    rc = entry(["kernels", *FAST, "--out", str(tmp_path), *extra])
    assert rc == 0
    (json_path,) = tmp_path.glob("*-kernels.json")
    data = json.loads(json_path.read_text())
    data["md"] = json_path.with_suffix(".md").read_text()
    return data


def _rows(data: dict, op: str) -> list[dict]:
    return [r for r in data["rows"] if r["op"] == op]


def test_runner_writes_json_and_markdown(tmp_path):
    data = _run(tmp_path, "--no-compile")
    machine = data["machine"]
    for key in ("device", "device_name", "torch", "torch_threads", "date_utc", "git_commit"):
        assert key in machine
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", machine["date_utc"])
    assert data["copy_bandwidth"]["gbps"] > 0 and data["read_bandwidth"]["gbps"] > 0
    assert {r["op"] for r in data["rows"]} == set(cases.OPS)
    for r in data["rows"]:
        assert r["ref_ms"] is not None and r["ref_ms"] > 0, f"{r['op']} {r['case']}: no baseline"
        assert r["nbytes"] > 0
        if r["error"] is None:  # the op ran: it was validated, timed and put against the copy and read bandwidths
            assert r["ours_ms"] > 0 and r["max_err"] is not None and r["pct_copy"] > 0 and r["pct_read"] > 0
            assert math.isclose(r["gbps"], r["nbytes"] / r["ours_ms"] / 1e6)
        else:
            assert r["ours_ms"] is None
        assert r["notes"]["compile"] == "skipped"
    md = data["md"].splitlines()
    assert md[0].startswith("# ") and any(line.startswith("Machine: ") for line in md[:6])
    assert any(line.startswith("Date (UTC): ") for line in md[:6])
    header = next(line for line in md if line.startswith("| op |"))
    assert [c.strip() for c in header.strip("|").split("|")] == table.COLUMNS
    assert sum(1 for line in md if line.startswith("| ") and not line.startswith("| op |")) == len(data["rows"])


def test_cli_entry_point_and_op_selection(tmp_path):
    data = _run(tmp_path, "--no-compile", "--ops", "slot_mapping", entry=lambda argv: cli_main(["bench", *argv]))
    assert {r["op"] for r in data["rows"]} == {"slot_mapping"}


def test_unknown_op_is_refused(tmp_path, capsys):
    assert main(["kernels", *FAST, "--out", str(tmp_path), "--ops", "rms_norm,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_op_that_raises_is_an_error_row_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(stagewise.ops, "rms_norm", broken)
    data = _run(tmp_path, "--no-compile", "--ops", "rms_norm,merge_attn_states")
    norm_rows = _rows(data, "rms_norm")
    assert norm_rows and all("kernel exploded" in r["error"] for r in norm_rows)
    assert all(r["ref_ms"] > 0 for r in norm_rows)
    assert _rows(data, "merge_attn_states")
    assert "kernel exploded" in data["md"]


def test_a_working_op_is_validated_timed_and_rated(tmp_path, monkeypatch):
    # Stand in for the kernel with the reference itself: zero error, a timing, a bandwidth.
    def merge_by_reference(out_a, lse_a, out_b, lse_b, *, out, lse):
        o, s = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
        out.copy_(o), lse.copy_(s)
        return out, lse

    monkeypatch.setattr(stagewise.ops, "merge_attn_states", lambda *a, out=None, lse=None: merge_by_reference(
        *a, out=torch.empty_like(a[0]) if out is None else out, lse=torch.empty_like(a[1]) if lse is None else lse))
    (row,) = _rows(_run(tmp_path, "--no-compile", "--ops", "merge_attn_states"), "merge_attn_states")
    assert row["error"] is None and row["max_err"] == 0.0
    assert row["ours_ms"] > 0 and row["gbps"] > 0 and row["pct_copy"] > 0 and row["ref_speedup"] > 0


def test_compile_baseline_is_timed_or_reported_na(tmp_path, monkeypatch):
    # torch.compile itself is too slow for a smoke test; what is tested is the runner's handling.
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    (row,) = _rows(_run(tmp_path / "ok", "--ops", "slot_mapping"), "slot_mapping")
    assert row["compile_ms"] > 0 and "compile_s" in row["notes"]

    def failing_compile(fn, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", failing_compile)
    (row,) = _rows(_run(tmp_path / "na", "--ops", "slot_mapping"), "slot_mapping")
    assert row["compile_ms"] is None
    assert row["notes"]["compile"].startswith("n/a") and "no compiler" in row["notes"]["compile"]


def test_device_slug():
    """The CPU's model, core count and the ISA level the kernels run at: an AVX2-only CPU of the
    same model name gets another name (and so other results files)."""
    slug = report.device_slug("cpu")
    isa = stagewise.ops.cpu_isa()
    assert re.fullmatch(r"cpu(-[a-z0-9]+)*-\d+c-(baseline|avx2|avx512|avx512vnni)", slug)
    assert slug.endswith(f"-{os.cpu_count()}c-{isa}")


@pytest.mark.parametrize("with_new", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_decode_attention_matches_reference(with_new, dtype):
    block, hq, hk, d, num_blocks = 4, 8, 2, 16, 32
    seq_lens = torch.tensor([0, 1, 4, 13, 30], dtype=torch.int32)  # empty, partial and full blocks
    tables = torch.randint(0, num_blocks, (5, 8), dtype=torch.int32)
    tables[0, :] = -1  # entries past a sequence's length are never read: garbage must not matter
    tables[2, 1:] = 10_000
    k_cache = torch.randn(num_blocks, block, hk, d).to(dtype)
    v_cache = torch.randn(num_blocks, block, hk, d).to(dtype)
    q = torch.randn(5, hq, d).to(dtype)
    k_new = torch.randn(5, hk, d).to(dtype) if with_new else None
    v_new = torch.randn(5, hk, d).to(dtype) if with_new else None
    args = (q, k_cache, v_cache, tables, seq_lens, d**-0.5, k_new, v_new)
    out, lse = ab.torch_decode_attention(*args)
    out_ref, lse_ref = ref.decode_attention(*args)
    assert out.shape == (5, hq, d) and out.dtype == dtype and lse.shape == (5, hq) and lse.dtype == torch.float32
    # Both compute in float32 and round once at the end: float32 accumulation order
    # is all that differs, and one rounding step (2^-7) of bfloat16 on the output.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(out, out_ref, **tol)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    if not with_new:  # nothing to attend to: lse -inf, output 0
        assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()


def _paged(dtype, device, seq_lens):
    """Paged K/V (block 4, 2 KV heads of 16) whose tables point anywhere, or at -1, past each length."""
    k_cache, v_cache, tables, _ = paged_kv(seq_lens, 2, 16, 4, dtype, device)
    return k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_pages_and_sdpa_decode_match_reference(device, dtype):
    k_cache, v_cache, tables, seq_lens = _paged(dtype, device, [0, 1, 4, 13, 30])  # empty, partial, full blocks
    q = torch.randn(5, 8, 16, device=device).to(dtype)
    k_new, v_new = (torch.randn(5, 2, 16, device=device).to(dtype) for _ in range(2))
    gathered = ab.gather_pages(k_cache, tables, k_new)
    assert gathered.shape == (5, tables.size(1) * 4 + 1, 2, 16) and gathered.is_contiguous()
    for b, n in enumerate(seq_lens.tolist()):
        torch.testing.assert_close(gathered[b, :n], ref.gather_kv(k_cache, v_cache, tables[b], n, 0, None, None)[0],
                                   rtol=0, atol=0)  # fmt: skip
        assert torch.equal(gathered[b, -1], k_new[b])
    args = (q, k_cache, v_cache, tables, seq_lens, 16**-0.5, k_new, v_new)
    out = ab.sdpa_decode_attention(*args)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref.decode_attention(*args)[0], **TOLERANCES[dtype])


_EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@_EAGER_FLEX
@pytest.mark.parametrize("with_new", [False, True])
def test_flex_decode_matches_reference(device, with_new):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention  # eager: the compiled one is the GPU run's

    k_cache, v_cache, tables, seq_lens = _paged(torch.float32, device, [1, 4, 13, 30] if not with_new else [0, 5, 32])
    b = seq_lens.numel()
    q = torch.randn(b, 8, 16, device=device)
    k_new, v_new = (torch.randn(b, 2, 16, device=device) if with_new else None for _ in range(2))
    args = (q, k_cache, v_cache, tables, seq_lens, 16**-0.5, k_new, v_new)
    out = ab.flex_decode(*args, flex=flex_attention)()
    torch.testing.assert_close(out, ref.decode_attention(*args)[0], **TOLERANCES[torch.float32])


@_EAGER_FLEX
def test_flex_extend_matches_reference(device):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    k_cache, v_cache, tables, seq_lens = _paged(torch.float32, device, [7, 30, 12])
    starts = torch.tensor([0, 3, 3, 15], dtype=torch.int32, device=device)  # runs of 3, 0 and 12 tokens
    q = torch.randn(15, 8, 16, device=device)
    args = (q, k_cache, v_cache, tables, starts, seq_lens, 16**-0.5)
    out = ab.flex_extend(*args, flex=flex_attention)()
    torch.testing.assert_close(out, ref.extend_attention(*args), **TOLERANCES[torch.float32])


def test_attention_rows_have_the_further_baselines(tmp_path):
    """On the CPU: SDPA checked against ours and timed, flex n/a with its reason, both in the table."""
    data = _run(tmp_path, "--no-compile", "--ops", "decode_attention,extend_attention")
    (decode,) = _rows(data, "decode_attention")
    assert decode["sdpa_ms"] > 0 and decode["sdpa_speedup"] > 0 and decode["notes"]["sdpa_max_err"] < 5e-2
    assert decode["flex_ms"] is None and decode["notes"]["flex"] == ab.FLEX_NOTE_CPU
    (extend,) = _rows(data, "extend_attention")
    assert extend["sdpa_ms"] is None and extend["notes"]["sdpa"].startswith("= ref")
    assert "Max abs error of the further baselines against ours" in data["md"]
    assert all(set(case.others) <= set(table.OTHERS) for case in (
        cases.build_case(op, dtype, size, "cpu") for op, dtype, size in cases.case_specs("cpu", list(cases.OPS), "tiny")))
