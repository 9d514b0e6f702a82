"""Shared fixtures: the tiny model pairs, the upstream wheel tree, vLLM's CPU settings."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# The tests' shared helpers (tests/*.py: used by several folders of tests, each folder by
# part: ops, attention, recurrent, engine, tools, standin, cuda), the scripts' modules, and
# gpu_machine/ (tooling for the GPU machine, not in the package).
sys.path[:0] = [str(TESTS), str(REPO / "scripts"), str(REPO)]


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (scripts/test.sh runs one worker per core) each worker and what it
    starts keep to a core of their own, computing on one thread. Unpinned, torch's thread
    per core in every worker oversubscribes the machine, and the CUDA emulator's thousand
    threads a block, woken across both cores, took 711 s for a test that takes 35 s on its
    own core while the other core is busy. vLLM servers a worker starts bind their OpenMP
    threads to that core too. Set before torch starts its thread pool."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))


_share_the_cores_between_workers()

import pytest  # noqa: E402
import torch  # noqa: E402

# vLLM on a CPU-only machine: a small KV cache, and the engine in this process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter (read when
# kernels are defined, so before any test module imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_xor_sum_with_numpy() -> None:
    """Triton's interpreter reduces by a Python loop per element unless it knows the
    combine function; tl.sort's compare-and-swap is an xor_sum, so a sort of 2048 keys
    took 8 s. numpy's xor reduce is the same reduction."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is tl.standard._xor_combine:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis,
                                                        keepdims=self.keep_dims),
                                  input[0].dtype)
        return reduce(self, input)

    interpreter.ReduceOps.apply_impl = apply_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_xor_sum_with_numpy()


def pytest_configure(config: pytest.Config) -> None:
    """Tests that share a machine-wide resource (a Ray cluster, a server's port, the
    in-place native build) share an xdist_group, so that one worker runs them in turn.
    pytest-xdist 3.8 names a test's group in its node id, which pytest 9.2 stopped letting it
    do: the groups were silently split across workers."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    xdist_minor = tuple(int(part) for part in xdist.__version__.split(".")[:2])
    if pytest.version_tuple >= (9, 2) and xdist_minor <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} and pytest-xdist {xdist.__version__} split "
            "--dist loadgroup's groups across workers: scripts/setup_env.sh installs a "
            "pytest below 9.2")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked scheduled_first go first (in their order): handed to a parallel worker
    last, one would end the run alone for minutes."""
    items.sort(key=lambda item: item.get_closest_marker("scheduled_first") is None)


@pytest.fixture(autouse=True)
def _collect_only_what_the_test_made():
    """vLLM collects garbage about nine times an engine start. Each full collection walks
    every object torch, vLLM and earlier tests left (0.5 s with one engine loaded): half of
    an engine test's time. After each test what is still alive is frozen, so later
    collections walk only what later tests make."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _free_what_the_module_held():
    """Module fixtures (a shared engine) end with the module: unfreeze, so their objects
    can be collected."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(scope="session")
def emulated_cuda_ops():
    """The CUDA ops' source (csrc/cuda/tree_ops.cu) built for the CPU emulator."""
    import cuda_emulator

    return cuda_emulator.load()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 target and DFlash drafter (scripts/make_tiny_models.py)."""
    import make_tiny_models

    out = tmp_path_factory.mktemp("tiny")
    make_tiny_models.make(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hand-built tiny Qwen3-Next target (Gated DeltaNet + full attention, bf16, large
    greedy margins) and a random DFlash drafter (scripts/make_tiny_models.py --hybrid)."""
    import make_tiny_models

    out = tmp_path_factory.mktemp("tiny_hybrid")
    make_tiny_models.make_hybrid(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same hand-built target as Qwen3.5 ships (Qwen3_5ForConditionalGeneration: split
    GDN projections, a dense MLP, M-RoPE) and drafter (make_tiny_models.py --hybrid qwen3_5)."""
    import make_tiny_models

    out = tmp_path_factory.mktemp("tiny_qwen3_5")
    make_tiny_models.make_hybrid(out, seed=0, arch="qwen3_5")
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_5_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same as a text-only Qwen3.5 checkpoint (Qwen3_5ForCausalLM: 1-D RoPE in vLLM)."""
    import make_tiny_models

    out = tmp_path_factory.mktemp("tiny_qwen3_5_text")
    make_tiny_models.make_hybrid(out, seed=0, arch="qwen3_5_text")
    return out


@pytest.fixture(scope="session")
def upstream_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``vllm/*.py`` tree of the official CUDA wheel of the pinned release."""
    import zipfile

    from vllm_ddtree.upstream import extract_from_wheel, fetch_wheel, pinned_version

    wheel = fetch_wheel(pinned_version())
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    return extract_from_wheel(wheel, tmp_path_factory.mktemp("upstream"), names)
