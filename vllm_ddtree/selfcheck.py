"""What an install of vllm-ddtree needs, checked one thing at a time, each failure with its
fix: ``vllm-ddtree doctor`` and ``python -m vllm_ddtree.selfcheck`` (the same checks; the
Docker image runs the latter at build time).

The checks: which vLLM environment this is (vllm-cpu, the 0.34 CPU stand-in, the official
build), the installed vLLM against the pin (``patches/upstream-version``), the patch
series' state on it, the native ops (which library file, whether it loads, CPU and CUDA
kernels, built after its sources), TREE_ATTN registered and importable, method "ddtree"
configurable, vLLM's plugin entry point, the device (torch, CUDA, the GPU) and, without a
GPU, the ISA of vLLM's CPU attention (AMX and Linux's permission for it). None starts an
engine. A failure makes the exit status 1; a warning does not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL, SKIP = "ok", "warn", "FAILED", "skipped"
OPS = ("build_tree", "verify_tree", "compact_tree", "tree_positions")
PACKAGE_DIR = Path(__file__).resolve().parent
REBUILD = "rebuild the native ops: `pip install --no-build-isolation -e .` in the checkout"
APPLY = "run `vllm-ddtree patches apply`"
PLUGIN = "install it as vLLM's plugin: `pip install --no-build-isolation -e .` in the checkout"
# The CPU stand-in's .pth file in site-packages (cpu_standin/build.py writes it): named here,
# where the doctor looks for it, since the stand-in is no part of this package.
STANDIN_PTH = "vllm_ddtree_cpu_standin.pth"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


# --- inputs (the tests replace these) -------------------------------------------------------

def vllm_root() -> Path | None:
    """The folder holding the installed ``vllm/``, found without importing it."""
    from vllm_ddtree.upstream import installed_vllm_root

    try:
        return installed_vllm_root()
    except RuntimeError:
        return None


def vllm_distribution() -> str | None:
    """``vllm-cpu`` (vLLM's CPU build) or ``vllm``, whichever is installed."""
    for name in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def standin_pth() -> Path | None:
    """The CPU stand-in's ``.pth`` file in this environment (``cpu_standin/`` in the
    checkout), if it is one."""
    import sysconfig

    path = Path(sysconfig.get_paths()["purelib"]) / STANDIN_PTH
    return path if path.is_file() else None


def ops_library() -> Path | None:
    """The native ops' library file this Python would load (``vllm_ddtree/_C*.so``)."""
    spec = importlib.util.find_spec("vllm_ddtree._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


def load_ops() -> None:
    importlib.import_module("vllm_ddtree._C")


def has_kernel(op: str, dispatch_key: str) -> bool:
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_ddtree::{op}", dispatch_key)


def registered_ops() -> set[str]:
    import torch

    return {op for op in OPS if hasattr(torch.ops.vllm_ddtree, op)}


def device() -> dict:
    """torch's version and CUDA build, and the GPUs it sees."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            gpus.append((torch.cuda.get_device_name(i), f"{major}.{minor}"))
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus}


def amx_permission_held() -> bool:
    """Whether Linux lets this process run AMX tile instructions (arch_prctl
    ARCH_GET_XCOMP_PERM, bit XFEATURE_XTILEDATA); asks nothing."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    mask = ctypes.c_ulong(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, GET_XCOMP_PERM
        return False
    return bool(mask.value >> 18 & 1)


def cpu_attention() -> dict:
    """The CPU's AMX (by CPUID), the ISA vLLM's CPU_ATTN chooses per dtype (blocks of 128,
    heads of 128), and then whether this process holds Linux's AMX permission."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = {name: _get_attn_isa(dtype, 128, 128, "auto")
           for name, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32))}
    return {"amx": torch.cpu._is_amx_tile_supported(), "isa": isa,
            "permission": amx_permission_held()}


def run_on_cuda() -> None:
    """One op on GPU 0: raises where the library's CUDA kernels do not run on it."""
    import torch

    seq_lens = torch.tensor([3], dtype=torch.int32, device="cuda")
    depths = torch.tensor([[0, 1, 1]], dtype=torch.int32, device="cuda")
    got = torch.ops.vllm_ddtree.tree_positions(seq_lens, depths).cpu().tolist()
    if got != [[3, 4, 4]]:
        raise RuntimeError(f"tree_positions on the GPU gave {got}, not [[3, 4, 4]]")


def sources_newer_than(library: Path) -> list[str]:
    """The build's sources (an editable checkout's csrc/ and setup.py) changed after it."""
    repo = PACKAGE_DIR.parent
    sources = [repo / "setup.py", *(repo / "csrc").rglob("*")] if (repo / "csrc").is_dir() else []
    built = library.stat().st_mtime
    return [str(p.relative_to(repo)) for p in sources if p.is_file() and p.stat().st_mtime > built]


def load_plugins() -> None:
    """vLLM's general plugins, as its processes load them (vllm_ddtree's registers TREE_ATTN
    and the methods)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def tree_attn_backend() -> tuple[str, Callable[[], object]] | None:
    """TREE_ATTN's path in vLLM's AttentionBackendEnum and its loader, or None."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_plugins()
    member = AttentionBackendEnum.__members__.get("TREE_ATTN")
    return None if member is None else (member.get_path(), member.get_class)


def registered_methods() -> set[str]:
    """The speculative methods plugins registered in vLLM's speculator registry."""
    from vllm.v1.worker.gpu.spec_decode import speculator_config

    load_plugins()
    return set(speculator_config._CUSTOM_CONFIGS)


def plugin_entry_points() -> list[str]:
    return [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]


# --- the checks -----------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def check_environment(dist: str | None, pth: Path | None) -> Check:
    """Which vLLM environment this is: vLLM's CPU build, the 0.34 CPU stand-in, or the
    official (GPU) build."""
    name = "environment"
    if pth is not None:
        # The .pth imported cpu_standin.activate when this Python started, unless it is stale
        # (it imported vllm_ddtree.cpu_standin before the stand-in left the package).
        if "cpu_standin.activate" not in sys.modules:
            return Check(name, FAIL, f"a CPU stand-in environment ({pth.name}) whose stand-in "
                         "did not load: its .pth does not import cpu_standin.activate from "
                         "this checkout", "scripts/setup_env.sh")
        standin = sys.modules["cpu_standin"]
        return Check(name, OK, f"the vLLM {standin.VLLM_VERSION} CPU stand-in "
                     f"({pth.name}): the official wheel with {standin.OP_LIBRARY_DIST} "
                     f"{standin.OP_LIBRARY_VERSION}'s op library and PyTorch versions of "
                     "V2's Triton kernels (cpu_standin/), the rest interpreted")
    if dist == "vllm-cpu":
        return Check(name, OK, "vllm-cpu: vLLM's CPU build")
    if dist == "vllm":
        return Check(name, OK, "vllm: vLLM's official (CUDA) build")
    return Check(name, FAIL, "no vLLM installed", "scripts/setup_env.sh")


def check_vllm_version(root: Path | None, series_dir: Path) -> Check:
    from vllm_ddtree.upstream import pinned_version, tree_version

    pin = pinned_version(series_dir)
    install = (f"install vllm=={pin} (on a machine without a GPU its CPU stand-in; "
               "`scripts/setup_env.sh` installs the right one)")
    if root is None:
        return Check("vLLM version", FAIL, f"vLLM is not installed in {sys.executable}",
                     install)
    try:
        found = tree_version(root)
    except (OSError, RuntimeError) as e:
        return Check("vLLM version", FAIL, f"no vLLM version at {root / 'vllm'}: {e}", install)
    dist = vllm_distribution()
    where = f"{found}{f' ({dist})' if dist else ''} at {root / 'vllm'}"
    if found != pin:
        return Check("vLLM version", FAIL, f"{where}; the series is for {pin}",
                     f"this vLLM is {found}, the series is for {pin}: {install}, or rebase the "
                     f"series with `scripts/rebase_upstream.py --to {found}`")
    return Check("vLLM version", OK, f"{where}, the series' pin")


def _series_changes(root: Path, series_dir: Path) -> list[str]:
    """How the series in ``series_dir`` differs from the one last applied to ``root``."""
    from vllm_ddtree.patching import PatchState, read_series

    state = PatchState.load(root)
    applied = {p["name"]: p["sha256"] for p in state.series} if state else {}
    now = {p.name: p.sha256 for p in read_series(series_dir)}
    return ([f"{n} is new" for n in now if n not in applied]
            + [f"{n} changed" for n in now if n in applied and applied[n] != now[n]]
            + [f"{n} left the series" for n in applied if n not in now])


def check_series(root: Path | None, series_dir: Path, version_ok: bool) -> Check:
    from vllm_ddtree.patching import PatchError, series_status
    from vllm_ddtree.patching.installer import APPLIED, MODIFIED, NOT_APPLIED

    if root is None:
        return Check("patch series", SKIP, "no vLLM to patch (see vLLM version)")
    try:
        status = series_status(root, series_dir)
    except PatchError as e:
        return Check("patch series", FAIL, f"the series in {series_dir} cannot be read: {e}",
                     "restore patches/ (`git status patches/` shows what changed)")
    target = root / "vllm"
    first = "" if version_ok else "install the pinned vLLM first (see vLLM version), then "
    if status.state == APPLIED:
        names = status.details
        return Check("patch series", OK, f"applied to {target}: {len(names)} patches "
                     f"({names[0]} .. {names[-1]})" if names else f"applied to {target}")
    if status.state == NOT_APPLIED:
        return Check("patch series", FAIL, f"not applied to {target}", first + APPLY)
    if status.state == MODIFIED:
        files = [d.split(" changed after apply")[0] for d in status.details]
        return Check("patch series", FAIL,
                     f"{len(files)} file(s) the series patched changed after apply (vLLM "
                     f"reinstalled or edited): {', '.join(files)}",
                     first + "run `vllm-ddtree patches revert --force`, then `vllm-ddtree "
                     "patches apply`")
    changes = _series_changes(root, series_dir)
    return Check("patch series", FAIL,
                 f"stale: applied to {target}, but the series changed since: "
                 + "; ".join(changes), first + APPLY)


def check_native_ops() -> Check:
    import torch

    library = ops_library()
    tag = sys.implementation.cache_tag
    if library is None:
        return Check("native ops", FAIL,
                     f"no native ops library for this Python ({tag}) in {PACKAGE_DIR}", REBUILD)
    try:
        load_ops()
    except (ImportError, OSError) as e:
        return Check("native ops", FAIL, f"{library} does not load: {_first_line(e)}",
                     f"{REBUILD} (against this torch, {torch.__version__})")
    missing = [op for op in OPS if op not in registered_ops()]
    if missing:
        return Check("native ops", FAIL, f"{library} loads but registers no "
                     f"torch.ops.vllm_ddtree.{', '.join(missing)}", REBUILD)
    if not all(has_kernel(op, "CPU") for op in OPS):
        return Check("native ops", FAIL, f"{library} has no CPU kernels", REBUILD)
    cuda = all(has_kernel(op, "CUDA") for op in OPS)
    kernels = "CPU and CUDA kernels" if cuda else "CPU kernels, no CUDA kernels"
    gpus = device()["gpus"]
    if gpus and not cuda:
        return Check("native ops", FAIL, f"{library}: {kernels}, but a GPU is here",
                     "rebuild them with CUDA (nvcc needed): `FORCE_CUDA=1 pip install "
                     "--no-build-isolation -e .`")
    if gpus:
        try:
            run_on_cuda()
        except Exception as e:  # any CUDA error is the finding
            name, arch = gpus[0]
            return Check("native ops", FAIL, f"{library}: the CUDA kernels do not run on "
                         f"{name} (compute capability {arch}): {_first_line(e)}",
                         f"rebuild them for this GPU: `TORCH_CUDA_ARCH_LIST={arch} "
                         "FORCE_CUDA=1 pip install --no-build-isolation -e .`")
    stale = sources_newer_than(library)
    if stale:
        shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        return Check("native ops", WARN, f"{library} loads ({kernels}), but {shown} changed "
                     "after it was built", REBUILD)
    return Check("native ops", OK, f"{library} loads: {kernels}")


def check_tree_attn() -> Check:
    try:
        found = tree_attn_backend()
    except Exception as e:
        return Check("TREE_ATTN", FAIL, f"vLLM's attention registry does not import: "
                     f"{_first_line(e)}", "see vLLM version and patch series")
    if found is None:
        return Check("TREE_ATTN", FAIL, "not in vLLM's AttentionBackendEnum (vLLM did not "
                     "load vllm_ddtree's plugin: see vLLM plugin)", PLUGIN)
    path, load = found
    if not path.startswith("vllm_ddtree."):
        return Check("TREE_ATTN", FAIL, f"points at {path}, not at vllm_ddtree's backend",
                     "something overrides TREE_ATTN (AttentionBackendEnum.TREE_ATTN"
                     ".register); remove that, or " + APPLY)
    try:
        load()
    except Exception as e:
        return Check("TREE_ATTN", FAIL, f"{path} does not import: {_first_line(e)}",
                     "reinstall vllm_ddtree: `pip install --no-build-isolation -e .`")
    return Check("TREE_ATTN", OK, f"registered: {path}")


def check_method() -> Check:
    try:
        methods = registered_methods()
    except Exception as e:
        return Check("method ddtree", FAIL, f"vLLM's speculator registry does not import: "
                     f"{_first_line(e)}", "see vLLM version and patch series")
    from vllm_ddtree.spec_decode.options import METHODS

    missing = sorted(set(METHODS) - methods)
    if missing:
        return Check("method ddtree", FAIL, f"{', '.join(missing)} not in vLLM's speculator "
                     "registry (vLLM did not load vllm_ddtree's plugin: see vLLM plugin)",
                     PLUGIN)
    return Check("method ddtree", OK, f"registered in vLLM's speculator registry "
                 f"({', '.join(METHODS)})")


# vLLM's structured-output backends and the module each needs.
GRAMMAR_BACKENDS = {"xgrammar": "xgrammar", "guidance": "llguidance",
                    "outlines": "outlines_core", "lm-format-enforcer": "lmformatenforcer"}


def check_structured_output() -> Check:
    """Which structured-output backends verify trees: every installed one, through the
    scheduler's walk along the tree (patch 0014; spec_decode/grammar_tree.py uses only the
    accept, rollback and fill every backend has)."""
    import dataclasses
    import importlib.util

    try:
        from vllm.v1.outputs import DraftTokenIds
    except Exception as e:
        return Check("structured output", FAIL, f"vLLM's outputs do not import: "
                     f"{_first_line(e)}", "see vLLM version and patch series")
    if "draft_parents" not in {f.name for f in dataclasses.fields(DraftTokenIds)}:
        return Check("structured output", FAIL, "patch 0014 is not applied: structured "
                     "requests would get chain masks on trees", APPLY)
    found = [name for name, module in GRAMMAR_BACKENDS.items()
             if importlib.util.find_spec(module) is not None]
    return Check("structured output", OK, "trees verified with "
                 + (", ".join(found) if found else "no backend installed")
                 + " (the scheduler masks each node along its tree)")


def check_plugin() -> Check:
    if "vllm_ddtree:register" in plugin_entry_points():
        return Check("vLLM plugin", OK, "entry point vllm.general_plugins: vllm_ddtree:register")
    return Check("vLLM plugin", WARN, "vllm_ddtree is not installed as vLLM's plugin (no "
                 "vllm.general_plugins entry point): vLLM's processes will not load it at "
                 "start-up", PLUGIN)


def check_device(dist: str | None) -> Check:
    info = device()
    build = f"CUDA {info['cuda']} build" if info["cuda"] else "CPU build"
    if info["gpus"]:
        where = "; ".join(f"GPU {i}: {name} (compute capability {arch})"
                          for i, (name, arch) in enumerate(info["gpus"]))
    else:
        where = "CUDA not available: the CPU runs everything"
    detail = f"torch {info['torch']} ({build}); {where}"
    if dist == "vllm" and not info["gpus"]:
        return Check("device", WARN, detail + "; this vLLM is its CUDA build and needs a GPU",
                     "run where a GPU is visible (`nvidia-smi`; in Docker `docker run --gpus "
                     "all`); or on a CPU-only machine `scripts/setup_env.sh`, which builds the "
                     "CPU stand-in")
    if dist in ("vllm-cpu", "vllm-cpu-standin") and info["gpus"]:
        return Check("device", WARN, detail + "; this vLLM is its CPU build (vllm-cpu): the "
                     "GPU is not used", "for the GPU install the pinned vllm (not vllm-cpu) in "
                     "a fresh environment")
    return Check("device", OK, detail)


def check_cpu_attention(root: Path | None) -> Check:
    name = "CPU attention"
    if root is None:
        return Check(name, SKIP, "needs vLLM (see vLLM version)")
    if device()["gpus"]:
        return Check(name, SKIP, "a GPU runs attention")
    try:
        info = cpu_attention()
    except Exception as e:
        return Check(name, FAIL, f"vLLM's CPU attention does not import: {_first_line(e)}",
                     "see vLLM version and patch series")
    chosen = ", ".join(f"{dtype}: {isa}" for dtype, isa in info["isa"].items())
    if not info["amx"]:
        return Check(name, OK, f"CPU_ATTN's ISA {chosen} (no AMX on this CPU)")
    if info["isa"]["bf16"] == "amx" and not info["permission"]:
        return Check(name, FAIL, f"CPU_ATTN's ISA {chosen}, without Linux's AMX permission: "
                     "bf16 attention would die with SIGILL (patch 0010 is not in effect)",
                     APPLY)
    if info["isa"]["bf16"] != "amx":
        return Check(name, WARN, f"CPU_ATTN's ISA {chosen}: the CPU has AMX but Linux refused "
                     "this process AMX state, so bf16 attention runs without it (slower)",
                     "Linux 5.16 or later, and no seccomp rule refusing arch_prctl")
    return Check(name, OK, f"CPU_ATTN's ISA {chosen} (AMX, Linux's permission held)")


def run_checks(root: Path | None = None, series_dir: Path | None = None) -> list[Check]:
    """Every check, in order; ``root`` (the folder holding ``vllm/``) and ``series_dir``
    default to the installed vLLM's and this checkout's ``patches/``."""
    from vllm_ddtree.upstream import patches_dir

    root = root if root is not None else vllm_root()
    series_dir = series_dir or patches_dir()
    version = check_vllm_version(root, series_dir)
    checks = [check_environment(vllm_distribution(), standin_pth()), version,
              check_series(root, series_dir, version.status == OK), check_native_ops()]
    if root is None:
        checks += [Check(name, SKIP, "needs vLLM (see vLLM version)")
                   for name in ("TREE_ATTN", "method ddtree", "structured output")]
    else:
        checks += [check_tree_attn(), check_method(), check_structured_output()]
    # The stand-in is the official wheel made for CPUs: no "needs a GPU" warning there.
    dist = vllm_distribution() if standin_pth() is None else "vllm-cpu-standin"
    return checks + [check_plugin(), check_device(dist), check_cpu_attention(root)]


def report(checks: list[Check], prog: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [prog]
    for c in checks:
        lines.append(f"  {c.status:<7} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"  {'':<7} {'':<{width}}  fix: {c.fix}")
    failed = [c.name for c in checks if c.status == FAIL]
    warned = [c.name for c in checks if c.status == WARN]
    if failed:
        summary = f"{len(failed)} of {len(checks)} checks FAILED: {', '.join(failed)}"
    else:
        summary = f"all {len(checks)} checks passed"
    if warned:
        summary += f" ({len(warned)} warning{'s' if len(warned) > 1 else ''}: " \
                   f"{', '.join(warned)})"
    return "\n".join([*lines, f"{prog}: {summary}"])


def main(argv: list[str] | None = None, prog: str = "vllm-ddtree selfcheck") -> int:
    checks = run_checks()
    print(report(checks, prog))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
