"""The real GPU bundle in an environment like the lent H200's: Python 3.12 (pyenv's), PyPI's
torch 2.11.0 (the machine's CUDA 13.0 build; it imports without a GPU) and the packages the
machine's image holds, with no vLLM. The bundle is built, staged over two commands as on
the machine, and then: `import vllm`, the series applies, the selfcheck passes, an engine
config builds for a Qwen3-8B-shaped target and a Qwen3-8B-DFlash-b16-shaped drafter under
method ddtree, and the compiled-op stand-in is chosen (no libcuda here), covers what vLLM's
CUDA path dereferences at import, has the compiled library's schemas and equals vLLM's
native implementations.

Heavy and slow (about 4 GB of downloads, cached in VLLM_DDTREE_CACHE, and the bundle's xz
about 2 minutes on 2 cores when the builder's code changed): marked slow. Without a GPU
vLLM runs here on its CPU platform (VLLM_TARGET_DEVICE=cpu), and CUDA-only imports are
checked with the CUDA platform forced and a stub libcuda that lets the compiled libraries
load (nothing of them runs).
"""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from vllm_ddtree.upstream import WHEEL_CACHE, cache_lock, pinned_version

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
PIN = pinned_version()
# The lent machine's image (the device tool's KINDS.md, 2026-11): versions where known.
H200_PACKAGES = (
    "torch==2.11.0", "transformers==5.17.0", "tokenizers==0.23.2", "numpy==2.5.2",
    "huggingface-hub==1.33.0", "safetensors==0.8.0", "sentencepiece==0.2.2",
    "tiktoken==0.14.0", "regex", "psutil", "requests", "tqdm", "py-cpuinfo", "protobuf",
    "aiohttp", "prometheus-client", "pillow", "opencv-python-headless", "pyyaml", "six",
    "setuptools", "einops", "cloudpickle", "ninja", "numba", "anyio", "httpx", "httpcore",
    "h11", "idna", "certifi", "click", "typer", "rich", "uvloop", "msgpack", "jinja2",
    "filelock", "fsspec", "packaging", "nvidia-ml-py",
)
# One test worker builds the bundle and stages it for every test here (scripts/test.sh),
# first: eight minutes on a cold machine.
pytestmark = [pytest.mark.slow, pytest.mark.scheduled_first,
              pytest.mark.xdist_group("gpu_bundle_env")]


def python312() -> str:
    found = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))
    found += [p for p in [shutil.which("python3.12")] if p]
    if not found:
        raise RuntimeError("no Python 3.12 here (pyenv's ~/.pyenv/versions/3.12.*): the GPU "
                           "bundle's environment needs it")
    return found[0]


@pytest.fixture(scope="session")
def h200_like_python() -> Path:
    """A cached venv with the machine's Python, torch and image packages (no vLLM)."""
    key = hashlib.sha256("\n".join(H200_PACKAGES).encode()).hexdigest()[:12]
    venv = WHEEL_CACHE.parent / f"h200-like-py312-{key}"
    py = venv / "bin" / "python"
    with cache_lock(venv.name):  # another test worker may be building it
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", *H200_PACKAGES],
                           check=True)
            (venv / ".complete").write_text(key)
    return py


def cache_entry(prefix: str, sources: list[Path]) -> Path:
    """``<cache>/<prefix>-<hash of the sources' paths and bytes>``, the other entries of
    ``prefix`` removed (call it holding ``cache_lock(prefix)``): what is built from these
    sources is built again only when one of them changed."""
    key = hashlib.sha256()
    for source in sorted(p for p in sources if p.is_file()):
        key.update(str(source.relative_to(REPO)).encode() + b"\0" + source.read_bytes())
    entry = WHEEL_CACHE.parent / f"{prefix}-{key.hexdigest()[:12]}"
    for old in WHEEL_CACHE.parent.glob(f"{prefix}-*"):
        if old != entry:
            shutil.rmtree(old, ignore_errors=True)
    return entry


@pytest.fixture(scope="session")
def bundle() -> Path:
    """Built into the cache under a name of the builder's code (the script and the staging
    it packs for): after a change to either it builds afresh; otherwise the builder's own
    check (every part there with its hash, the inputs' hashes unchanged) finds it up to
    date, which spares the xz's two minutes a suite run."""
    with cache_lock("gpu-bundle"):
        out = cache_entry("gpu-bundle", [REPO / "scripts" / "gpu_bundle.py",
                                         *(REPO / "gpu_machine").glob("*.py")])
        subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_bundle.py"), "--out",
                        str(out)], check=True)
    return out


def run(py: Path, code: str, env: dict[str, str], *args: str, check: bool = True
        ) -> subprocess.CompletedProcess:
    done = subprocess.run([str(py), "-c", code, *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="session")
def staged(bundle: Path, h200_like_python: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, str]:
    """The bundle staged as on the machine: each command's folder carried alone, in order
(told what is still missing until the last); the series applied, the native ops built for
this Python. Returns the environment the staged bundle runs in."""
    work = tmp_path_factory.mktemp("stage")
    env_file = work / "env.sh"
    py = str(h200_like_python)
    numbers = [c["number"] for c in json.loads((bundle / "manifest.json").read_text())[
        "commands"]]
    for number in numbers:
        want = 0 if number == numbers[-1] else 3
        carried = work / f"carried-{number}"
        shutil.copytree(bundle / f"command-{number}", carried / f"command-{number}")
        done = subprocess.run([py, "-m", "gpu_machine.stage", "--bundle",
                               str(carried), "--work", str(work / "tmp"), "--env-file",
                               str(env_file)], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == want, done.stdout + done.stderr
    assert "brought by command 2" in subprocess.run(
        [py, "-m", "gpu_machine.stage", "--bundle", str(work / "carried-1"), "--work",
         str(work / "again"), "--env-file", str(env_file) + ".x"],
        capture_output=True, text=True, cwd=REPO).stderr
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=f"{work / 'tmp' / 'site'}{os.pathsep}{REPO}")
    env.pop("TRITON_INTERPRET", None)
    assert f"PYTHONPATH={work / 'tmp' / 'site'}:{REPO}" in env_file.read_text()
    build_native_ops(py, h200_like_python.parents[1].name, dict(env, FORCE_CPU="1"))
    done = subprocess.run([py, "-m", "vllm_ddtree.cli", "patches", "apply"], env=env,
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("applied "), done.stderr
    return dict(env, SITE=str(work / "tmp" / "site"), ENV_FILE=str(env_file))


def build_native_ops(py: str, venv: str, env: dict[str, str]) -> None:
    """``setup.py build_ext --inplace`` with the machine's Python (its ``_C`` beside this
    one's), the library cached under a name of the venv and the sources: built again only
    when csrc/ or setup.py changed (a minute on 2 cores)."""
    suffix = run(Path(py), "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))",
                 env).stdout.strip()
    library = REPO / "vllm_ddtree" / f"_C{suffix}"
    prefix = f"native-ops-{venv}"
    with cache_lock(prefix):
        cached = cache_entry(prefix, [REPO / "setup.py", *(REPO / "csrc").rglob("*")])
        if (cached / library.name).is_file():
            shutil.copy2(cached / library.name, library)
            return
        built = subprocess.run([py, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO,
                               env=env, capture_output=True, text=True)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]  # say why
        cached.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, cached / library.name)


def test_the_bundle_holds_what_the_dense_path_needs_in_few_commands(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["expects"] == {"python": "3.12", "torch": "2.11", "cuda": "13.0"}
    assert [c["name"] for c in manifest["components"]] == [
        "vllm-python", "vllm-c", "vllm-fa3", "deps"]
    assert len(manifest["commands"]) == 3  # 95 MiB (vLLM 0.34): three beside the working tree
    for cmd in manifest["commands"]:
        files = sorted((bundle / f"command-{cmd['number']}").iterdir())
        assert {f.name for f in files} == {*cmd["parts"], "manifest.json"}
        assert sum(f.stat().st_size for f in files if f.name != "manifest.json") \
            <= manifest["command_mib"] * MIB
    for part in manifest["parts"]:
        path = next(bundle.glob(f"command-*/{part['file']}"))
        assert part["bytes"] <= manifest["part_mib"] * MIB
        assert hashlib.sha256(path.read_bytes()).hexdigest() == part["sha256"]
    python = next(c for c in manifest["components"] if c["name"] == "vllm-python")
    data = b"".join(next(bundle.glob(f"command-*/{p}")).read_bytes() for p in python["parts"])
    with tarfile.open(fileobj=lzma.LZMAFile(__import__("io").BytesIO(data))) as tar:
        names = tar.getnames()
    assert "vllm/platforms/cuda.py" in names and f"vllm-{PIN}.dist-info/METADATA" in names
    for absent in ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
                   "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/_C_stable_libtorch.abi3.so"):
        assert absent not in names
    assert not [n for n in names if n.startswith("vllm/third_party/deep_gemm/")
                and not n.endswith(".py")]


def test_rebuilding_with_the_parts_present_changes_nothing(bundle: Path) -> None:
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundle.rglob("*")
              if p.is_file()}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_bundle.py"), "--out",
                           str(bundle)], capture_output=True, text=True, check=True)
    assert "is up to date" in done.stdout
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundle.rglob("*")
             if p.is_file()}
    assert after == before


CONFIGURE = r"""
import sys
sys.path.insert(0, "scripts")
from pathlib import Path
from bench_gpu_throughput import SHAPES, write_models
from vllm.engine.arg_utils import EngineArgs

target, drafter = write_models(Path(sys.argv[1]), SHAPES["8b"], weights=False)
config = EngineArgs(model=str(target), load_format="dummy", dtype="bfloat16",
                    max_model_len=4096, speculative_config={
                        "method": "ddtree", "model": str(drafter), "tree_budget": 128}
                    ).create_engine_config()
spec = config.speculative_config
options = spec.speculator_options
print(config.model_config.hf_config.num_hidden_layers, spec.draft_model_config.hf_config
      .num_hidden_layers, options["tree_budget"], options["tree_depth"],
      spec.num_speculative_tokens, config.attention_config.backend)
"""


def test_staged_vllm_configures_ddtree_at_qwen3_8b_shapes(staged: dict[str, str],
                                                          h200_like_python: Path,
                                                          tmp_path: Path) -> None:
    done = run(h200_like_python, "import vllm; print(vllm.__version__, vllm.__file__)", staged)
    assert done.stdout.split()[0] == PIN
    assert done.stdout.split()[1].startswith(staged["SITE"])
    done = run(h200_like_python, "import sys; from vllm_ddtree.selfcheck import main; "
               "sys.exit(main())", staged)
    assert "vllm-ddtree selfcheck: all 10 checks passed" in done.stdout, done.stdout
    done = run(h200_like_python, CONFIGURE, staged, str(tmp_path))
    # 36 target layers, 5 drafter layers, budget 128, depth 15 (block 16); on the CPU platform
    # no backend is selected here (the speculator takes CPU_ATTN's place at engine start).
    assert done.stdout.split()[-6:] == ["36", "5", "128", "15", "128", "None"], \
        done.stdout[-2000:]


FORCE_CUDA_PLATFORM = r"""
import vllm.platforms as platforms
from vllm.platforms import cuda
from vllm.platforms.interface import DeviceCapability

# No GPU here: the CUDA platform without NVML, as Hopper.
cuda.NonNvmlCudaPlatform.get_device_capability = classmethod(
    lambda cls, device_id=0: DeviceCapability(9, 0))
platforms._current_platform = cuda.NonNvmlCudaPlatform()
"""
IMPORTS = FORCE_CUDA_PLATFORM + r"""
import importlib
for name in ("vllm._custom_ops", "vllm.model_executor.layers.quantization.utils.w8a8_utils",
             "vllm.compilation.passes.pass_manager", "vllm.model_executor.models.qwen3",
             "vllm.model_executor.models.qwen3_dflash",
             "vllm.compilation.passes.utility.fix_functionalization"):
    importlib.import_module(name)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
with set_current_vllm_config(VllmConfig()):
    SiluAndMul()  # fetches torch.ops._C.silu_and_mul on CUDA
import torch
print(torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90))
print("imports ok")
"""
SCHEMAS = r"""
import json, sys, torch
if sys.argv[1] == "compiled":
    torch.ops.load_library(sys.argv[2])
else:
    from gpu_machine.standin_ops import register
    register()
from gpu_machine import standin_ops as s
names = [s.op_name(x) for x, _ in s.IMPLEMENTED + s.CALLED_AT_IMPORT] + [
    s.op_name(x) for x in s.SCHEMA_ONLY]
print(json.dumps({n: str(getattr(torch.ops._C, n).default._schema) for n in names}))
"""
NATIVE = FORCE_CUDA_PLATFORM + r"""
import torch
import vllm._C_stable_libtorch  # the stand-in
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope

torch.manual_seed(0)
with set_current_vllm_config(VllmConfig()):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(16, 256, dtype=dtype)
        norm = RMSNorm(256, eps=1e-6).to(dtype)
        norm.weight.data.normal_()
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, norm.weight.data, 1e-6)
        assert torch.allclose(out.float(), norm.forward_native(x).float(), atol=2e-2, rtol=2e-2)
        res = torch.randn_like(x)
        a, r = x.clone(), res.clone()
        torch.ops._C.fused_add_rms_norm(a, r, norm.weight.data, 1e-6)
        want, want_res = norm.forward_native(x, res)
        assert torch.allclose(r.float(), want_res.float(), atol=1e-2)
        assert torch.allclose(a.float(), want.float(), atol=6e-2, rtol=2e-2)
        gate = torch.randn(16, 512, dtype=dtype)
        out = torch.empty_like(x)
        torch.ops._C.silu_and_mul(out, gate)
        assert torch.allclose(out.float(), SiluAndMul().forward_native(gate).float(),
                              atol=2e-2, rtol=2e-2)
        rope = get_rope(128, max_position=4096, is_neox_style=True,
                        rope_parameters={"rope_theta": 1e6}, dtype=dtype)
        pos = torch.arange(16)
        q, k = torch.randn(16, 4 * 128, dtype=dtype), torch.randn(16, 2 * 128, dtype=dtype)
        wq, wk = rope.forward_native(pos, q.clone(), k.clone())
        torch.ops._C.rotary_embedding(pos, q, k, 128, rope.cos_sin_cache.to(dtype), True)
        assert torch.allclose(q.float(), wq.float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(k.float(), wk.float(), atol=2e-2, rtol=2e-2)
print("native ok")
"""


def build_stub_libcuda(libs: list[Path], out: Path) -> Path:
    """In ``out``, a libcuda.so.1 defining the driver functions ``libs`` link to (each
    returns an error): they load, nothing of them runs."""
    names = set()
    for lib in libs:
        listed = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], check=True,
                                capture_output=True, text=True).stdout
        names |= {w.split("@")[0] for w in listed.split() if w.startswith("cu")}
    (out / "stub.c").write_text("".join(f"int {n}(void) {{ return 999; }}\n"
                                        for n in sorted(names)))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"),
                    str(out / "stub.c")], check=True)
    return out


@pytest.fixture(scope="session")
def stub_libcuda(staged: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stub libcuda for the staged compiled libraries (build_stub_libcuda)."""
    site = Path(staged["SITE"])
    return build_stub_libcuda([site / "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
                               *site.glob("vllm/_C_stable_libtorch.abi3.so*")],
                              tmp_path_factory.mktemp("libcuda"))


def test_the_standin_takes_the_compiled_ops_place_and_covers_cuda_imports(
        staged: dict[str, str], h200_like_python: Path, stub_libcuda: Path) -> None:
    site = Path(staged["SITE"])
    compiled = site / "vllm/_C_stable_libtorch.abi3.so"
    done = subprocess.run([str(h200_like_python), "-m", "gpu_machine.compiled_ops",
                           "--site", str(site), "--env-file", staged["ENV_FILE"]],
                          capture_output=True, text=True, env=staged, cwd=REPO)
    assert done.returncode == 0, done.stderr
    # No libcuda here: the probe fails, the stand-in is chosen and said loudly.
    assert "PURE-PYTORCH STAND-IN" in done.stdout and "libcuda.so.1" in done.stdout
    assert "export VLLM_DDTREE_STANDIN_OPS=1" in Path(staged["ENV_FILE"]).read_text()
    assert (site / "vllm/_C_stable_libtorch.py").is_file() and not compiled.exists()
    with_stub = dict(staged, LD_LIBRARY_PATH=str(stub_libcuda), VLLM_TARGET_DEVICE="cuda")
    done = run(h200_like_python, IMPORTS, with_stub)
    assert done.stdout.split()[-3:] == ["False", "imports", "ok"], done.stdout
    run(h200_like_python, NATIVE, with_stub)
    # The stand-in's schemas are the compiled library's, argument names included.
    real = run(h200_like_python, SCHEMAS, with_stub, "compiled", str(compiled) + ".failed")
    ours = run(h200_like_python, SCHEMAS, with_stub, "standin")
    assert json.loads(ours.stdout.splitlines()[-1]) == json.loads(real.stdout.splitlines()[-1])


CONFIGURE_034 = FORCE_CUDA_PLATFORM + r"""
import importlib, sys
import torch
from vllm.engine.arg_utils import EngineArgs
pair = sys.argv[1]
config = EngineArgs(model=pair + "/target", max_model_len=512, speculative_config={
    "method": "dflash", "model": pair + "/drafter", "num_speculative_tokens": 15},
    ).create_engine_config()
for name in ("vllm._custom_ops", "vllm.model_executor.models.qwen3",
             "vllm.model_executor.models.qwen3_dflash", "vllm.v1.worker.gpu.model_runner",
             "vllm.v1.worker.gpu.spec_decode.dflash.speculator"):
    importlib.import_module(name)
torch.ops.load_library(sys.argv[2])  # FA3
ops = [s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("_C::")]
print(config.speculative_config.method, config.speculative_config.num_speculative_tokens,
      config.parallel_config.worker_cls, len(ops) > 100, "_C::rms_norm" in ops)
"""


def test_vllm_034s_compiled_files_load_on_the_machines_torch(
        h200_like_python: Path, tmp_path: Path) -> None:
    """vLLM 0.34.0 as `gpu_bundle.py --vllm 0.34.0` carries it (unpacked here, not xz'd):
    its _C_stable_libtorch and FA3 link no torch symbol outside the stable ABI, load on torch
    2.11 (CUDA 13.0 build) with a stub libcuda, and vLLM configures dflash for Hopper and
    imports V2's runner and DFlash speculator. Nothing runs a kernel: that is the GPU's."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_bundle

    from vllm_ddtree.upstream import fetch_wheel

    wheel = fetch_wheel("0.34.0")
    site = gpu_bundle.unpack(wheel, gpu_bundle.fetch_dependencies(WHEEL_CACHE / "gpu-deps"),
                             tmp_path / "site")
    compiled = [site / member for member in gpu_bundle.COMPILED.values()]
    for lib in compiled:
        undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], check=True,
                                   capture_output=True, text=True).stdout.split()
        assert not [s for s in undefined if s.startswith(("_ZN2at", "_ZN3c10", "_ZN5torch"))]
    (tmp_path / "libcuda").mkdir()
    stub = build_stub_libcuda(compiled, tmp_path / "libcuda")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                             "VLLM_TARGET_DEVICE")}
    env |= {"PYTHONPATH": str(site), "LD_LIBRARY_PATH": str(stub)}
    done = run(h200_like_python, CONFIGURE_034, env, str(REPO / "models" / "tiny-pair"),
               str(compiled[1]))
    assert done.stdout.split()[-5:] == ["dflash", "15", "vllm.v1.worker.gpu_worker.Worker",
                                        "True", "True"], done.stdout[-2000:]
