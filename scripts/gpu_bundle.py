#!/usr/bin/env python3
"""Build the GPU bundle: the pinned vLLM and the dependencies the lent GPU machine lacks, as
xz parts small enough to carry there a few device commands at a time.

The lent H200 has Python 3.12, torch 2.11 (CUDA 13.0) and no vLLM; a device command carries
at most 64 MiB (working tree included). vLLM 0.32's compiled files use only torch's stable C
ABI and load on torch 2.11 (../shared/notes/gpu-vllm-facts.md), so the bundle holds:

  vllm-python  vLLM's Python tree and its dist-info (platform detection reads the version),
               the small .so files, no FA2 / MoE / deep_gemm / MLA / vllm-rs files
  vllm-c       vllm/_C_stable_libtorch.abi3.so (the dense path's custom ops)
  vllm-fa3     vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (importing vllm_flash_attn needs
               FA2 or FA3; FA3 is the Hopper one and 11 MiB as xz)
  deps         the wheels of DEPENDENCIES, unpacked (import vllm, build an LLM)

Each component is a deterministic .tar.xz cut into parts of at most --part-mib; the parts
are packed into command folders of at most --command-mib (OUT/command-N/, each with a copy
of OUT/manifest.json: every part's sha256, what it holds, which command carries it, what the
machine must have). Downloads are cached (VLLM_DDTREE_CACHE); once cached this runs offline.
Re-running with the parts present and valid changes nothing. On the machine,
scripts/gpu_check.sh stages the parts (gpu_machine.stage); its header says how to
carry them.

  scripts/gpu_bundle.py                 # OUT = .gpu-bundle (git ignores it)
  scripts/gpu_bundle.py --part-mib 20 --command-mib 40  # (default: what the tree leaves)
  scripts/gpu_bundle.py --vllm 0.34.0   # another release whose compiled files were checked

vLLM 0.34.0's compiled files load the same way (_C_stable_libtorch and FA3 link no torch
symbol outside the stable ABI; tests/tools/test_gpu_bundle_env.py loads them on torch 2.11 with a
stub libcuda and builds a dflash config for Hopper); what needs the GPU (its kernels, CUDA
graphs) is the GPU run's.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_machine import stage  # noqa: E402
from vllm_ddtree.upstream import (  # noqa: E402
    WHEEL_CACHE,
    cache_lock,
    fetch_wheel,
    pinned_version,
)

FORMAT, MANIFEST, StageError = stage.FORMAT, stage.MANIFEST, stage.StageError
load_manifest, sha256_file = stage.load_manifest, stage.sha256_file

# What the lent machine has (../shared/notes/gpu-vllm-facts.md, the device tool's KINDS.md).
EXPECTS = {"python": "3.12", "torch": "2.11", "cuda": "13.0"}
# vLLM 0.32's requirements the machine lacks, for `import vllm` and an LLM on the dense
# Qwen3 + DFlash path (not `vllm serve`), pinned to versions that satisfy vLLM's pins.
DEPENDENCIES = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "cbor2==6.3.0", "pyzmq==27.3.0", "oss-harmony==0.0.11",
    "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5",
    "sniffio==1.3.1", "jiter==0.19.0", "distro==1.9.0", "msgspec==0.23.0",
    "pybase64==1.5.1", "cachetools==8.0.2", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11",
    "fastapi==0.136.3", "starlette==1.10.0", "partial-json-parser==0.2.1.1.post7",
    "llguidance==1.7.6", "setproctitle==1.3.8", "blake3==1.0.11",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any")
# Compiled files of the wheel that get components of their own; every other .so is left out
# unless it is small enough to ride with the Python tree.
COMPILED = {"vllm-c": "vllm/_C_stable_libtorch.abi3.so",
            "vllm-fa3": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}
SMALL_SO = ("vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so")
HEADER_DIRS = ("vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
MIB = 1 << 20
# Releases whose compiled files were checked to load on the machine's torch (stable ABI).
CHECKED_VERSIONS = ("0.32.0", "0.34.0")


def python_tree(name: str) -> bool:
    """Whether a wheel member belongs to the vllm-python component."""
    if name.endswith("/"):
        return False
    if name.startswith("vllm-") and ".dist-info/" in name:
        return True
    if not name.startswith("vllm/") or name == "vllm/vllm-rs":
        return False
    if name.endswith(".so"):
        return name in SMALL_SO
    return not (name.startswith(HEADER_DIRS) and not name.endswith(".py"))


def fetch_dependencies(dest: Path) -> list[Path]:
    """The cp312 manylinux wheels of DEPENDENCIES, downloaded once."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    with cache_lock(dest.name):  # another process may be downloading them
        for req in DEPENDENCIES:
            name, version = req.split("==")
            stem = f"{name.replace('-', '_')}-{version}-".lower()
            found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
            if not found:
                cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                       "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                       "cp", "--dest", str(dest), req]
                for plat in PLATFORMS:
                    cmd += ["--platform", plat]
                subprocess.run(cmd, check=True)
                found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
            if len(found) != 1:
                raise SystemExit(f"gpu_bundle: expected one wheel for {req} in {dest}, "
                                 f"found {[p.name for p in found]}")
            wheels.append(found[0])
    return wheels


def _tar_xz(members: list[tuple[str, bytes]]) -> bytes:
    """A reproducible .tar.xz: sorted names, no owners, no times."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755 if name.endswith(".so") \
                else 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    # The xz tool with two threads: 330 MB at preset 6 take about a minute that way.
    return subprocess.run(["xz", "-6", "-T2", "-c"], input=raw.getvalue(),
                          capture_output=True, check=True).stdout


def components(vllm_wheel: Path, dep_wheels: list[Path]) -> dict[str, tuple[str, bytes]]:
    """name -> (what it holds, .tar.xz bytes)."""
    out = {}
    with zipfile.ZipFile(vllm_wheel) as zf:
        names = zf.namelist()
        tree = [(n, zf.read(n)) for n in names if python_tree(n)]
        out["vllm-python"] = (f"vLLM's Python tree and dist-info from {vllm_wheel.name}, "
                              f"{len(tree)} files", _tar_xz(tree))
        for comp, member in COMPILED.items():
            out[comp] = (f"{member} from {vllm_wheel.name}",
                         _tar_xz([(member, zf.read(member))]))
    deps = []
    for wheel in dep_wheels:
        with zipfile.ZipFile(wheel) as zf:
            deps += [(n, zf.read(n)) for n in zf.namelist()
                     if not n.endswith("/") and ".data/" not in n.split("/")[0] + "/"]
    out["deps"] = ("unpacked wheels: " + ", ".join(w.name for w in dep_wheels), _tar_xz(deps))
    return out


def pack_commands(parts: list[tuple[str, int]], command_bytes: int) -> list[list[str]]:
    """First fit, largest first: parts into as few commands of ``command_bytes`` as fit."""
    commands: list[tuple[int, list[str]]] = []
    for name, size in sorted(parts, key=lambda p: (-p[1], p[0])):
        if size > command_bytes:
            raise SystemExit(f"gpu_bundle: part {name} ({size / MIB:.1f} MiB) exceeds a "
                             f"command ({command_bytes / MIB:.1f} MiB): lower --part-mib")
        for i, (used, names) in enumerate(commands):
            if used + size <= command_bytes:
                commands[i] = (used + size, names + [name])
                break
        else:
            commands.append((size, [name]))
    return [sorted(names) for _, names in commands]


def inputs_key(wheels: list[Path], part_mib: float, command_mib: float) -> str:
    digest = hashlib.sha256(json.dumps(
        [FORMAT, EXPECTS, list(DEPENDENCIES), sorted(COMPILED.items()), list(SMALL_SO),
         part_mib, command_mib]).encode())
    for wheel in wheels:
        digest.update(f"{wheel.name}:{sha256_file(wheel)}".encode())
    return digest.hexdigest()


def up_to_date(out: Path, key: str) -> bool:
    """The manifest is this build's and every part it lists is there with its hash."""
    try:
        manifest = load_manifest(out / MANIFEST)
    except (OSError, ValueError, StageError):
        return False
    if manifest.get("key") != key:
        return False
    for cmd in manifest["commands"]:
        for part in (p for p in manifest["parts"] if p["file"] in cmd["parts"]):
            path = out / f"command-{cmd['number']}" / part["file"]
            if not path.is_file() or sha256_file(path) != part["sha256"]:
                return False
    return True


def unpack(vllm_wheel: Path, dep_wheels: list[Path], dest: Path) -> Path:
    """What the bundle carries, unpacked into ``dest`` (a site folder) without the xz
    parts: for checks here of what staging on the machine gives."""
    with zipfile.ZipFile(vllm_wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if python_tree(n)]
                      + list(COMPILED.values()))
    for wheel in dep_wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest, [n for n in zf.namelist() if not n.endswith("/")
                                 and ".data/" not in n.split("/")[0] + "/"])
    return dest


def build(out: Path, part_mib: float, command_mib: float, version: str | None = None) -> dict:
    version = version or pinned_version()
    if version not in CHECKED_VERSIONS:
        raise SystemExit(f"gpu_bundle: vLLM {version}: only {', '.join(CHECKED_VERSIONS)} "
                         "were checked to load on the machine's torch 2.11 (stable ABI)")
    vllm_wheel = fetch_wheel(version)
    dep_wheels = fetch_dependencies(WHEEL_CACHE / "gpu-deps")
    key = inputs_key([vllm_wheel, *dep_wheels], part_mib, command_mib)
    if up_to_date(out, key):
        print(f"gpu_bundle: {out} is up to date")
        return load_manifest(out / MANIFEST)
    return write_bundle(out, components(vllm_wheel, dep_wheels), key, part_mib, command_mib,
                        {"vllm": version, "inputs": [w.name for w in [vllm_wheel, *dep_wheels]]})


def write_bundle(out: Path, comps: dict[str, tuple[str, bytes]], key: str, part_mib: float,
                 command_mib: float, extra: dict) -> dict:
    """Cut each component into parts, group the parts into command folders, write the
    manifest (in ``out`` and in every command folder)."""
    part_bytes, command_bytes = int(part_mib * MIB), int(command_mib * MIB)
    listed, parts, blobs = [], [], {}
    for name, (holds, data) in comps.items():
        names = []
        for i, start in enumerate(range(0, len(data), part_bytes)):
            piece = data[start:start + part_bytes]
            file = f"{name}.tar.xz.{i:02d}"
            blobs[file] = piece
            names.append(file)
            parts.append({"file": file, "component": name, "bytes": len(piece),
                          "sha256": hashlib.sha256(piece).hexdigest()})
        listed.append({"name": name, "holds": holds, "bytes": len(data), "parts": names,
                       "sha256": hashlib.sha256(data).hexdigest()})
    grouped = pack_commands([(p["file"], p["bytes"]) for p in parts], command_bytes)
    rel = out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out
    commands = [{"number": i + 1, "carry": f"{rel}/command-{i + 1}", "parts": names,
                 "mib": round(sum(len(blobs[n]) for n in names) / MIB, 1)}
                for i, names in enumerate(grouped)]
    manifest = {"format": FORMAT, "key": key, **extra, "expects": EXPECTS,
                "part_mib": part_mib, "command_mib": command_mib,
                "components": listed, "parts": parts, "commands": commands}
    text = json.dumps(manifest, indent=1) + "\n"
    for old in out.glob("command-*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for cmd in commands:
        folder = out / f"command-{cmd['number']}"
        folder.mkdir(parents=True)
        for name in cmd["parts"]:
            (folder / name).write_bytes(blobs[name])
        (folder / MANIFEST).write_text(text)
    (out / MANIFEST).write_text(text)
    return manifest


def default_command_mib(carried_mib: int = 64, margin_mib: int = 4) -> float:
    """What a device command can carry beside the working tree (the files git tracks or
    does not ignore travel with every command), in whole MiB so that small edits to the
    tree do not change the bundle."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / os.fsdecode(name)).stat().st_size for name in listed
               if name and (REPO / os.fsdecode(name)).is_file())
    return float(math.floor(carried_mib - tree / MIB - margin_mib))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    parser.add_argument("--part-mib", type=float, default=28.0,
                        help="largest part (default 28)")
    parser.add_argument("--command-mib", type=float, default=None,
                        help="parts one command carries, at most (default: the 64 MiB a "
                             "command carries less this working tree and 4 MiB, in whole MiB)")
    parser.add_argument("--vllm", default=None,
                        help=f"the vLLM release (default: the pin; checked: "
                             f"{', '.join(CHECKED_VERSIONS)})")
    args = parser.parse_args(argv)
    command_mib = args.command_mib or default_command_mib()
    manifest = build(args.out, args.part_mib, command_mib, args.vllm)
    for cmd in manifest["commands"]:
        print(f"command {cmd['number']}: carry {cmd['carry']} ({cmd['mib']} MiB: "
              f"{', '.join(cmd['parts'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
