"""Stage the GPU bundle on the lent machine: gather the parts carried by this command and
by earlier ones, check every hash, unpack vLLM and its missing dependencies into one
folder, and write the shell settings that put it on the path.

The bundle (``scripts/gpu_bundle.py``) is split over several device commands, because a
command carries at most 64 MiB; the machine keeps /tmp for about 30 s after a command, so
parts staged under ``WORK`` (default ``/tmp/vllm-bundle``) by one command are found by the
next. Only the standard library is used before the version check: this runs under the
machine's own Python, with no vLLM. Nothing goes on the path until every part is present
and valid: the unpacked tree is built beside the old one and renamed into place.

  python3 -m gpu_machine.stage --env-file /tmp/vllm-bundle/env.sh [--bundle .gpu-bundle]

Exit status: 0 staged (or already staged), 2 refused (wrong machine, bad hash),
3 parts missing (the message names them and the command that brings them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
MISSING = 3
PLUGIN_ENTRY = "[vllm.general_plugins]\nddtree = vllm_ddtree:register\n"


class StageError(Exception):
    """The bundle cannot be staged here; the message says why and what to do."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(path: Path) -> dict:
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise StageError(f"{path}: manifest format {manifest.get('format')!r}, this stage "
                         f"reads format {FORMAT}: rebuild with scripts/gpu_bundle.py")
    return manifest


def check_machine(expects: dict, python: str | None = None, torch_version: str | None = None,
                  cuda: str | None = None) -> None:
    """Refuse a machine whose Python or torch is not the one the bundle was built for."""
    python = python or ".".join(map(str, sys.version_info[:3]))
    if torch_version is None:
        try:
            import torch
        except ImportError:
            torch_version, cuda = "none", None
        else:
            torch_version, cuda = torch.__version__, torch.version.cuda
    have = f"Python {python}, torch {torch_version} (CUDA {cuda})"
    want = (f"Python {expects['python']}, torch {expects['torch']} "
            f"(CUDA {expects['cuda']})")
    ok = (python.startswith(expects["python"] + ".")
          and torch_version.split("+")[0].startswith(expects["torch"] + ".")
          and str(cuda).startswith(expects["cuda"]))
    if not ok:
        raise StageError(f"this bundle is for {want}; this machine has {have}. It never "
                         f"installs torch: rebuild the bundle for this machine or use one "
                         f"that matches")


def _carried(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.glob("command-*") if (p / MANIFEST).is_file())


def _command_of(manifest: dict, part: str) -> dict:
    return next(c for c in manifest["commands"] if part in c["parts"])


def _bring(manifest: dict, part: str) -> str:
    cmd = _command_of(manifest, part)
    return f"command {cmd['number']} (carry {cmd['carry']})"


def stage(bundle: Path, work: Path, check: bool = True) -> Path:
    """Stage what ``bundle`` (the carried folders) and ``work`` (earlier commands') hold;
    returns the unpacked site folder. Raises StageError; exits nothing."""
    carried = _carried(bundle) if bundle.is_dir() else []
    saved = work / MANIFEST
    if carried:
        manifest_path = carried[0] / MANIFEST
        for other in carried[1:]:
            if load_manifest(other / MANIFEST)["key"] != load_manifest(manifest_path)["key"]:
                raise StageError(f"{other} and {carried[0]} hold parts of different bundles: "
                                 f"rebuild with scripts/gpu_bundle.py")
    elif saved.is_file():
        manifest_path = saved
    else:
        raise StageError(f"no bundle: neither {bundle}/command-*/{MANIFEST} (carried by this "
                         f"command) nor {saved} (left by an earlier one). Build it with "
                         f"scripts/gpu_bundle.py and carry its command folders")
    manifest = load_manifest(manifest_path)
    if check:
        check_machine(manifest["expects"])
    parts_dir = work / "parts"
    if saved.is_file() and load_manifest(saved)["key"] != manifest["key"]:
        shutil.rmtree(work)  # an earlier bundle's leftovers
    parts_dir.mkdir(parents=True, exist_ok=True)
    if not saved.is_file():
        shutil.copyfile(manifest_path, saved)
    want = {p["file"]: p for p in manifest["parts"]}
    for folder in carried:
        for path in sorted(folder.iterdir()):
            if path.name == MANIFEST:
                continue
            part = want.get(path.name)
            if part is None:
                raise StageError(f"{path}: not a part of this bundle's manifest")
            if sha256_file(path) != part["sha256"]:
                raise StageError(f"part {path.name} has a wrong hash (carried in {folder}): "
                                 f"rebuild it with scripts/gpu_bundle.py and carry "
                                 f"{_bring(manifest, path.name)} again")
            shutil.copyfile(path, parts_dir / path.name)
    site = work / "site"
    done = site / ".staged"
    if done.is_file() and done.read_text() == manifest["key"]:
        return site
    missing = []
    for name, part in want.items():
        path = parts_dir / name
        if not path.is_file() or sha256_file(path) != part["sha256"]:
            path.unlink(missing_ok=True)
            missing.append(name)
    if missing:
        by_command: dict[int, list[str]] = {}
        for name in missing:
            by_command.setdefault(_command_of(manifest, name)["number"], []).append(name)
        lines = [f"  {', '.join(names)}: brought by {_bring(manifest, names[0])}"
                 for _, names in sorted(by_command.items())]
        raise _Missing("bundle parts missing (nothing was put on the path):\n"
                       + "\n".join(lines))
    fresh = work / "site.tmp"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    for component in manifest["components"]:
        _unpack(component, parts_dir, fresh)
    info = fresh / "vllm_ddtree-0+bundle.dist-info"  # the plugin's entry point for vLLM
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0+bundle\n")
    (info / "entry_points.txt").write_text(PLUGIN_ENTRY)
    (fresh / ".staged").write_text(manifest["key"])
    shutil.rmtree(site, ignore_errors=True)
    fresh.rename(site)
    return site


class _Missing(StageError):
    pass


def _unpack(component: dict, parts_dir: Path, dest: Path) -> None:
    """One component: its parts concatenated are one .tar.xz, checked, then unpacked."""
    joined = parts_dir / (component["name"] + ".tar.xz")
    with open(joined, "wb") as out:
        for name in component["parts"]:
            with open(parts_dir / name, "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256_file(joined) != component["sha256"]:
        raise StageError(f"component {component['name']}: its parts join to a wrong hash; "
                         f"rebuild with scripts/gpu_bundle.py")
    with lzma.open(joined) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        tar.extractall(dest, filter="data")
    joined.unlink()


def env_lines(site: Path, repo: Path) -> str:
    path = os.pathsep.join([str(site), str(repo)])
    return (f"export PYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f"export VLLM_DDTREE_BUNDLE_SITE={site}\n")


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=repo / ".gpu-bundle",
                        help="the carried command folders' parent (default: .gpu-bundle)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-bundle"))
    parser.add_argument("--env-file", type=Path, required=True,
                        help="written on success: shell lines to source")
    args = parser.parse_args(argv)
    args.env_file.unlink(missing_ok=True)
    try:
        site = stage(args.bundle, args.work)
    except _Missing as e:
        print(f"gpu bundle: {e}", file=sys.stderr)
        return MISSING
    except StageError as e:
        print(f"gpu bundle: error: {e}", file=sys.stderr)
        return 2
    args.env_file.write_text(env_lines(site, repo))
    print(f"gpu bundle: staged in {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
