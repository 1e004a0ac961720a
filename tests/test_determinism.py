"""The harness's verdicts do not depend on luck (SPEC §7): a read of uninitialized memory fails
every run, a printed ``reproduce`` line fails the same way again, and a failure that does not
repeat is reported as nondeterministic, not as a harness error."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest
import torch
from splitgrad.properties.backends import get_backend
from splitgrad.properties.front import campaign
from splitgrad.properties.front.campaign import FAIL, NONDETERMINISTIC, deterministic, run_cell
from splitgrad.properties.front.verify import main

UNINITIALIZED = textwrap.dedent(
    '''
    """The reference with one bug: Linear's output buffer comes from torch.empty and its last
    row is never written (what a kernel that skips its tail, or a K=0 GEMM that writes nothing,
    leaves behind). Without the fill it holds whatever the allocator hands back."""
    import torch
    from splitgrad.reference import *  # noqa: F403
    from splitgrad.reference import Linear as _Linear

    class Linear(_Linear):
        def forward(self, inp, is_first_microbatch=None):
            y = super().forward(inp, is_first_microbatch)
            out = torch.empty_like(y)
            rows = y.reshape(-1, y.shape[-1])
            out.view(-1, y.shape[-1])[:-1] = rows[:-1]
            return out
    '''
)

WRONG_DGRAD = textwrap.dedent(
    '''
    """The reference with one bug: Linear's input gradient is 1.5x too large when the input has
    at least 3 rows (a deterministic bug on some drawn shapes only)."""
    import torch
    from splitgrad.reference import *  # noqa: F403
    from splitgrad.reference import Linear as _Linear

    class _ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, dx):
            return dx * 1.5

    class Linear(_Linear):
        def forward(self, inp, is_first_microbatch=None):
            if inp.numel() // max(inp.shape[-1], 1) >= 3:
                inp = _ScaleGrad.apply(inp)
            return super().forward(inp, is_first_microbatch)
    '''
)


def _package(tmp_path: Path, name: str, source: str) -> str:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(source)
    return f"path:{pkg}"


def _torch_determinism() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


@pytest.mark.nondeterministic
def test_checks_run_deterministic_and_the_caller_mode_comes_back(monkeypatch) -> None:
    seen = []
    real = campaign.run_check

    def spy(property_id, backend, case):
        seen.append(_torch_determinism())
        return real(property_id, backend, case)

    monkeypatch.setattr(campaign, "run_check", spy)
    before = _torch_determinism()
    assert before[0] is False  # the marker turned the suite's mode off
    cell = run_cell(get_backend("reference"), "P1", "Linear", "bfloat16", examples=3)
    assert cell.status == "pass", cell.message
    assert len(seen) == cell.examples + cell.rejected >= 3
    assert set(seen) == {(True, True, True)}
    assert _torch_determinism() == before
    campaign.run_case(get_backend("reference"), "P1", cell_case())
    assert seen[-1] == (True, True, True) and _torch_determinism() == before


def cell_case():
    from splitgrad.properties.checks.registry import example_case

    return example_case("Linear", dtype="bfloat16")


def test_the_suite_itself_runs_with_uninitialized_memory_filled() -> None:
    assert _torch_determinism() == (True, True, True)
    assert torch.empty(4).isnan().all()


@pytest.mark.nondeterministic
def test_uninitialized_read_fails_every_run(tmp_path: Path) -> None:
    backend = get_backend(_package(tmp_path, "uninit_lib", UNINITIALIZED))
    for _ in range(3):
        cell = run_cell(backend, "P1", "Linear", "float32", examples=5)
        assert cell.status == FAIL, cell.message
        assert "nan" in cell.message.lower() and cell.first_failure_at == 1, cell.message
        assert not cell.nondeterministic


@pytest.mark.nondeterministic
def test_uninitialized_read_reproduces_from_the_printed_line(tmp_path: Path, capsys) -> None:
    backend = _package(tmp_path, "uninit_cli_lib", UNINITIALIZED)
    argv = ["--backend", backend, "--module", "Linear", "--dtype", "float32", "--property", "P1"]
    assert main([*argv, "--examples", "5", "--recipe", "none", "--impl-path", "none"]) == 1
    repro = _reproduce_line(capsys.readouterr().out)
    for _ in range(2):
        assert main(shlex.split(repro)[2:]) == 1
        out = capsys.readouterr().out
        assert "P1 FAIL" in out and "nan" in out.lower(), out


def _reproduce_line(out: str) -> str:
    return next(
        line.split("reproduce: ", 1)[1] for line in out.splitlines() if "reproduce: " in line
    )


def test_printed_reproduce_line_fails_with_the_same_property_and_tensor(
    tmp_path: Path, capsys
) -> None:
    backend = _package(tmp_path, "wrong_dgrad_lib", WRONG_DGRAD)
    argv = ["--backend", backend, "--module", "Linear", "--dtype", "bfloat16", "--property", "P2"]
    argv += ["--examples", "20", "--recipe", "none", "--impl-path", "none", "--threads", "1"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    failure = out.split("\nFAIL P2-Linear-bfloat16-none", 1)[1].splitlines()[1].strip()
    tensor = failure.split(":", 1)[0]
    assert tensor and "grad" in tensor, failure
    repro = _reproduce_line(out)
    args = shlex.split(repro)
    assert args[:2] == ["splitgrad", "verify"]
    assert args[args.index("--threads") + 1] == "1" and args[args.index("--device") + 1] == "cpu"
    assert args[args.index("--property") + 1] == "P2"
    assert main(args[2:]) == 1
    replayed = capsys.readouterr().out
    assert replayed.startswith("P2 FAIL"), replayed
    assert replayed.splitlines()[1].split(": ", 1)[1].startswith(f"{tensor}:"), replayed


def _fail_first_check(monkeypatch) -> None:
    """The run's first property check raises a planted failure; every later one runs."""
    calls = {"n": 0}
    real = campaign.run_check

    def fails_once(property_id, backend, case):
        calls["n"] += 1
        if calls["n"] == 1:
            raise AssertionError("output: planted first-call failure")
        return real(property_id, backend, case)

    monkeypatch.setattr(campaign, "run_check", fails_once)


def test_a_failure_that_does_not_repeat_is_reported_as_nondeterministic(monkeypatch) -> None:
    _fail_first_check(monkeypatch)
    cell = run_cell(get_backend("reference"), "P1", "Linear", "bfloat16", examples=5)
    assert cell.status == FAIL and cell.nondeterministic, cell.message
    assert cell.message.startswith(NONDETERMINISTIC)
    assert "first failure: output: planted first-call failure" in cell.message
    assert "could not run the campaign" not in cell.message
    assert cell.case is not None and "--case" in cell.repro and "--threads" in cell.repro


def test_verify_counts_a_nondeterministic_failure_as_failed(monkeypatch, capsys) -> None:
    _fail_first_check(monkeypatch)
    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "bfloat16"]
    assert main([*argv, "--property", "P1", "--examples", "4", "--recipe", "none"]) == 1
    out = capsys.readouterr().out
    assert "nondeterministic: failed once, passed on replay" in out
    assert "failing case: Linear" in out and "reproduce: splitgrad verify" in out


def test_deterministic_off_is_a_way_out_and_restores() -> None:
    with deterministic(False):
        assert not torch.are_deterministic_algorithms_enabled()
        with deterministic():
            assert torch.empty(2).isnan().all()
        assert not torch.are_deterministic_algorithms_enabled()
    assert _torch_determinism() == (True, True, True)
