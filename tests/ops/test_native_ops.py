"""The native op pipeline: vllm_ddtree._C builds, registers its ops with fake implementations,
runs on CPU like its Python reference, rejects bad input by name, and every CUDA source
compiles with nvcc (without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree import ops, reference

REPO = Path(__file__).resolve().parents[2]
I32, I64 = torch.int32, torch.int64


@settings(max_examples=200, deadline=None)
@given(num_reqs=st.integers(0, 8), num_nodes=st.integers(0, 70), seed=st.integers(0, 2**31),
       depth_dtype=st.sampled_from([I32, I64]))
def test_tree_positions_matches_reference(num_reqs, num_nodes, seed, depth_dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(0, 1 << 20, (num_reqs,), generator=gen)
    depths = torch.randint(0, 17, (num_reqs, num_nodes), generator=gen).to(depth_dtype)
    got = ops.tree_positions(seq_lens, depths)
    assert got.dtype == I64 and got.shape == (num_reqs, num_nodes)
    assert torch.equal(got, reference.tree_positions(seq_lens, depths))


def test_tree_positions_non_contiguous_input() -> None:
    seq_lens = torch.arange(0, 40, 2)[::4]
    depths = torch.arange(50, dtype=I32).reshape(5, 10)[:, ::2]
    assert not depths.is_contiguous()
    assert torch.equal(ops.tree_positions(seq_lens, depths),
                       reference.tree_positions(seq_lens, depths))


@pytest.mark.parametrize("seq_lens, depths, message", [
    (torch.zeros(2, 1, dtype=I64), torch.zeros(2, 3, dtype=I32), "'seq_lens' must be 1-D"),
    (torch.zeros(2, dtype=I64), torch.zeros(6, dtype=I32), "'depths' must be 2-D"),
    (torch.zeros(2, dtype=I32), torch.zeros(2, 3, dtype=I32), "'seq_lens' has wrong dtype"),
    (torch.zeros(2, dtype=I64), torch.zeros(2, 3), "'depths' has wrong dtype Float"),
    (torch.zeros(3, dtype=I64), torch.zeros(2, 3, dtype=I32), "'depths' has size 2 in dim 0"),
])
def test_tree_positions_rejects_bad_input_by_name(seq_lens, depths, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        ops.tree_positions(seq_lens, depths)


def test_fake_implementation_gives_shape_without_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = ops.tree_positions(torch.empty(4, dtype=I64), torch.empty(4, 9, dtype=I32))
    assert out.shape == (4, 9) and out.dtype == I64


def test_op_traces_into_one_graph() -> None:
    def step(seq_lens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return ops.tree_positions(seq_lens, depths) * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    seq_lens, depths = torch.tensor([3, 7]), torch.tensor([[0, 1, 1], [0, 1, 2]])
    assert torch.equal(compiled(seq_lens, depths), step(seq_lens, depths))


def test_plugin_entry_point_registers_ops_idempotently() -> None:
    from importlib.metadata import entry_points

    import vllm_ddtree

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ddtree"]
    assert ep.value == "vllm_ddtree:register"
    register = ep.load()
    register()
    register()
    assert vllm_ddtree._registered and hasattr(torch.ops.vllm_ddtree, "tree_positions")


def test_the_plugin_refuses_another_vllm_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_ddtree
    from vllm_ddtree import upstream

    monkeypatch.setattr(vllm_ddtree, "_registered", False)
    monkeypatch.setattr(upstream, "tree_version", lambda root: "0.33.0")
    pin = upstream.pinned_version()
    with pytest.raises(RuntimeError, match=rf"this vLLM is 0\.33\.0, but vllm-ddtree is for "
                       rf"vLLM {pin}"):
        vllm_ddtree.register()


@pytest.mark.slow
def test_every_cuda_source_compiles_with_nvcc() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts/check_cuda_compile.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sources = list((REPO / "csrc").rglob("*.cu"))
    assert sources and f"compiled {len(sources)} CUDA file(s)" in result.stdout


def test_bench_tree_ops_runs(tmp_path: Path) -> None:
    import json

    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts/bench_tree_ops.py"),
                             "--reqs", "1", "--repeats", "2", "--budgets", "16",
                             "--json", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["budget"] == 16 and row["build_from_topk"] > 0 and row["verify"] > 0


def test_bench_tree_ops_graphs_need_a_gpu() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts/bench_tree_ops.py"),
                             "--graphs"], capture_output=True, text=True)
    assert result.returncode == 2 and "--graphs needs --device cuda" in result.stderr


def run_gpu_check_on_stubs(tmp_path: Path, **limits: str):
    """scripts/gpu_check.sh with a stub GPU and a stub Python whose CUDA build fails and
    whose CUDA tests hang; ``limits`` are its *_LIMIT_S variables. Returns the finished
    process, the stub's command lines and the files left in $OUT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stub'\n")
    calls = tmp_path / "calls.log"
    (bin_dir / "python-stub").write_text(
        f'#!/bin/sh\necho "FORCE_CUDA=$FORCE_CUDA FORCE_CPU=$FORCE_CPU $*" >> {calls}\n'
        'case "$*" in *setup.py*) [ "$FORCE_CUDA" = 1 ] && exit 1;; '
        '*tests/cuda*) exec sleep 300;; *"import vllm"*) exit 1;; esac\n'
        'for a; do [ "$prev" = --json ] && echo {} > "$a"; prev=$a; done\necho 9.0\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "PYTHON": str(bin_dir / "python-stub"), "BUNDLE_DIR": str(tmp_path / "no-bundle"),
           "BUNDLE_WORK": str(tmp_path / "no-bundle-staged"), **limits}
    result = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    return result, calls.read_text(), {p.name: p for p in out.iterdir()}


def test_gpu_check_goes_on_after_a_failing_step(tmp_path: Path) -> None:
    # One device run must bring back every result it can: where the CUDA build fails and
    # the CUDA tests hang, the CPU ops are built instead, the hang is cut at its time limit,
    # the benchmarks still run, the summary names both failures, and $OUT holds no more
    # files than a lent machine brings back (eight).
    result, ran, files = run_gpu_check_on_stubs(tmp_path, STEP_LIMIT_S="2")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    summary = ["gpu_check: FAILED: CUDA build (exit 1)",
               "gpu_check: FAILED: CUDA tests (timed out after 2 s)"]
    assert all(line in result.stdout.splitlines() for line in summary), result.stdout[-3000:]
    assert "FORCE_CUDA= FORCE_CPU=1 setup.py -q build_ext --inplace" in ran
    assert "scripts/bench_tree_ops.py --device cuda --reqs 32" in ran
    assert "scripts/bench_tree_ops.py --device cuda --graphs --json" in ran
    assert "scripts/bench_tree_attention.py --json" in ran
    assert "scripts/bench_tree_attention.py --shape gpt-oss" in ran
    assert len(files) <= 8 and "gpu_check.log" in files, files
    assert all(line in files["gpu_check.log"].read_text() for line in summary)


@pytest.mark.slow
def test_gpu_check_ends_within_its_total_limit(tmp_path: Path) -> None:
    # A lent machine runs one command of limited time: under TOTAL_LIMIT_S the hung CUDA
    # tests get only what is left of the run (less the 15-s reserve), the steps after them
    # are not run, and the summary, naming them, is written in time.
    started = time.monotonic()
    result, ran, files = run_gpu_check_on_stubs(tmp_path, TOTAL_LIMIT_S="40")
    took = time.monotonic() - started
    assert took < 40, (took, result.stdout[-3000:])
    lines = result.stdout.splitlines()
    timed_out = [line for line in lines if line.startswith("gpu_check: FAILED: CUDA tests")]
    assert timed_out and int(timed_out[0].split("after ")[1].split()[0]) <= 25, lines
    assert "gpu_check: FAILED: tree op timings, 1 requests (not run: TOTAL_LIMIT_S spent)" \
        in lines, lines
    assert "bench_tree_ops.py" not in ran and "bench_tree_attention.py" not in ran, ran
    assert result.returncode == 2 + 6, lines  # the build, the tests, 6 steps not run
    assert "gpu_check: results in" in files["gpu_check.log"].read_text()


def test_cuda_headers_from_pip_where_the_toolkit_has_none(tmp_path: Path, monkeypatch) -> None:
    # An image with nvcc but no CUDA runtime headers (the cuda-nvcc package alone) builds
    # against the headers of pip's CUDA packages beside torch; a full toolkit adds nothing.
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setenv("FORCE_CPU", "1")
    include_dirs = runpy.run_path(str(REPO / "setup.py"))["_cuda_include_dirs"]
    site, toolkit = tmp_path / "site-packages", tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    for package in ("cu13", "cublas"):
        (site / "nvidia" / package / "include").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "include" / "cuda_runtime.h").touch()
    assert include_dirs(str(toolkit), site) == [str(site / "nvidia" / "cu13" / "include")]
    (toolkit / "include" / "cuda_runtime.h").touch()
    assert include_dirs(str(toolkit), site) == []
