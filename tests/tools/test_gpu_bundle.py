"""The GPU bundle's logic on small fake bundles: parts grouped into commands, staging over
several device commands, refusals that name the part, the command or the versions, and
nothing on the path unless everything checked out. (The real bundle, in a Python 3.12 /
torch 2.11 environment like the lent machine's: tests/tools/test_gpu_bundle_env.py.)"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gpu_bundle
import pytest

from gpu_machine import stage

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def test_parts_are_packed_into_few_commands() -> None:
    parts = [("a.00", 28 * MIB), ("a.01", 24 * MIB), ("b.00", 12 * MIB), ("c.00", 11 * MIB),
             ("d.00", 7 * MIB)]
    commands = gpu_bundle.pack_commands(parts, 56 * MIB)
    assert commands == [["a.00", "a.01"], ["b.00", "c.00", "d.00"]]
    with pytest.raises(SystemExit, match="a.00 .* exceeds a command"):
        gpu_bundle.pack_commands(parts, 20 * MIB)


def test_the_python_component_leaves_out_what_the_dense_path_does_not_need() -> None:
    keep = ["vllm/__init__.py", "vllm-0.32.0.dist-info/METADATA", "vllm/spinloop.abi3.so",
            "vllm/third_party/deep_gemm/__init__.py"]
    drop = ["vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/",
            "vllm/third_party/deep_gemm/include/deep_gemm/x.cuh",
            "vllm/third_party/fmha_sm100/kernel.h", "torch/__init__.py"]
    assert [n for n in keep + drop if gpu_bundle.python_tree(n)] == keep


def fake_bundle(out: Path, key: str = "k1") -> dict:
    """Two components in three parts over two commands."""
    comps = {
        "big": ("a big file", gpu_bundle._tar_xz([("pkg_big/blob.bin", bytes(range(256)) * 40)])),
        "small": ("a module", gpu_bundle._tar_xz([("pkg_small/__init__.py", b"X = 1\n")])),
    }
    half = len(comps["big"][1]) // 2 + 1
    part_mib = half / MIB  # "big" in two parts
    command_mib = (half + len(comps["small"][1]) + 1) / MIB  # one big part a command
    return gpu_bundle.write_bundle(out, comps, key, part_mib, command_mib, {})


def run_stage(bundle: Path, work: Path, env: Path) -> tuple[int, str]:
    code = ("import sys; from gpu_machine import stage; "
            "stage.check_machine = lambda *a, **k: None; sys.exit(stage.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "--bundle", str(bundle), "--work",
                           str(work), "--env-file", str(env)], capture_output=True, text=True,
                          cwd=REPO)
    return done.returncode, done.stdout + done.stderr


def carry(out: Path, dest: Path, numbers: list[int]) -> Path:
    """What a device command's working tree holds: the carried command folders only."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for n in numbers:
        shutil.copytree(out / f"command-{n}", dest / f"command-{n}")
    return dest


def test_staging_over_two_commands(tmp_path: Path) -> None:
    out, work, env = tmp_path / "bundle", tmp_path / "work", tmp_path / "env.sh"
    manifest = fake_bundle(out)
    assert len(manifest["commands"]) == 2
    first = next(c for c in manifest["commands"] if "small.tar.xz.00" not in c["parts"])
    second = next(c for c in manifest["commands"] if c is not first)
    # The first command brings its parts, which are kept; it is told what is missing.
    rc, log = run_stage(carry(out, tmp_path / "c1", [first["number"]]), work, env)
    assert rc == stage.MISSING, log
    for name in second["parts"]:
        assert name in log
    assert f"command {second['number']} (carry {second['carry']})" in log
    assert not env.exists() and not (work / "site").exists()  # nothing on the path
    # The next command brings the rest: staged, with vLLM's plugin entry point for ours.
    rc, log = run_stage(carry(out, tmp_path / "c2", [second["number"]]), work, env)
    assert rc == 0, log
    site = work / "site"
    assert (site / "pkg_big" / "blob.bin").read_bytes() == bytes(range(256)) * 40
    assert (site / "pkg_small" / "__init__.py").read_text() == "X = 1\n"
    entry = next(site.glob("vllm_ddtree-*.dist-info")) / "entry_points.txt"
    assert "ddtree = vllm_ddtree:register" in entry.read_text()
    assert f"PYTHONPATH={site}:" in env.read_text()
    # A third command with nothing carried finds it staged.
    rc, log = run_stage(tmp_path / "none", work, env)
    assert rc == 0 and "staged" in log, log


def test_a_bad_part_is_named_and_nothing_is_staged(tmp_path: Path) -> None:
    out, work, env = tmp_path / "bundle", tmp_path / "work", tmp_path / "env.sh"
    manifest = fake_bundle(out)
    carried = carry(out, tmp_path / "all", [1, 2])
    name = manifest["commands"][1]["parts"][0]
    path = carried / "command-2" / name
    path.write_bytes(b"!" + path.read_bytes()[1:])
    rc, log = run_stage(carried, work, env)
    assert rc == 2, log
    assert f"part {name} has a wrong hash" in log and "command 2 (carry" in log
    assert not env.exists() and not (work / "site").exists()


def test_a_part_changed_after_staging_is_brought_again(tmp_path: Path) -> None:
    """Parts left by an earlier command are checked again before unpacking."""
    out, work, env = tmp_path / "bundle", tmp_path / "work", tmp_path / "env.sh"
    manifest = fake_bundle(out)
    rc, _ = run_stage(carry(out, tmp_path / "c1", [1]), work, env)
    assert rc == stage.MISSING
    left = work / "parts" / manifest["commands"][0]["parts"][0]
    left.write_bytes(b"rot")
    rc, log = run_stage(carry(out, tmp_path / "c2", [2]), work, env)
    assert rc == stage.MISSING and left.name in log and "command 1 (carry" in log, log


def test_a_new_bundle_replaces_an_old_ones_leftovers(tmp_path: Path) -> None:
    work, env = tmp_path / "work", tmp_path / "env.sh"
    fake_bundle(tmp_path / "old", key="old")
    assert run_stage(carry(tmp_path / "old", tmp_path / "c", [1, 2]), work, env)[0] == 0
    fake_bundle(tmp_path / "new", key="new")
    rc, log = run_stage(carry(tmp_path / "new", tmp_path / "c", [1]), work, env)
    assert rc == stage.MISSING, log
    assert not (work / "site").exists()


def test_another_python_or_torch_is_refused_naming_both() -> None:
    expects = {"python": "3.12", "torch": "2.11", "cuda": "13.0"}
    stage.check_machine(expects, "3.12.3", "2.11.0+cu130", "13.0")
    with pytest.raises(stage.StageError, match=r"for Python 3\.12, torch 2\.11 \(CUDA 13\.0\); "
                       r"this machine has Python 3\.11\.7, torch 2\.13\.0\+cpu \(CUDA None\)"):
        stage.check_machine(expects, "3.11.7", "2.13.0+cpu", None)
    with pytest.raises(stage.StageError, match="torch 2.12.0"):
        stage.check_machine(expects, "3.12.3", "2.12.0+cu130", "13.0")


def test_the_machine_check_runs_first(tmp_path: Path) -> None:
    """This machine (Python 3.11, CPU torch) is refused before anything is copied."""
    fake_bundle(tmp_path / "bundle")
    done = subprocess.run([sys.executable, "-m", "gpu_machine.stage", "--bundle",
                           str(tmp_path / "bundle"), "--work", str(tmp_path / "work"),
                           "--env-file", str(tmp_path / "env.sh")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert "this bundle is for Python 3.12" in done.stderr
    assert f"this machine has Python {sys.version.split()[0]}" in done.stderr
    assert not (tmp_path / "work" / "parts").exists()


def test_rewriting_an_unchanged_bundle_is_detected(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    manifest = fake_bundle(out)
    assert gpu_bundle.up_to_date(out, manifest["key"])
    assert not gpu_bundle.up_to_date(out, "another key")
    part = out / "command-1" / manifest["commands"][0]["parts"][0]
    part.write_bytes(part.read_bytes() + b"x")
    assert not gpu_bundle.up_to_date(out, manifest["key"])


def test_parts_hash_and_join_to_their_components(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    manifest = fake_bundle(out)
    for comp in manifest["components"]:
        data = b"".join((out / f"command-{c['number']}" / p).read_bytes()
                        for p in comp["parts"] for c in manifest["commands"]
                        if p in c["parts"])
        assert hashlib.sha256(data).hexdigest() == comp["sha256"]
    for cmd in manifest["commands"]:
        assert sum(p["bytes"] for p in manifest["parts"] if p["file"] in cmd["parts"]) \
            <= manifest["command_mib"] * MIB


def test_gpu_check_stops_and_names_what_the_next_command_brings(tmp_path: Path) -> None:
    """A device command that carries part of the bundle: gpu_check.sh stages it, stops with
    exit 3 before building anything, and its log names the parts the next command brings."""
    import json
    import os

    import torch

    out = tmp_path / "bundle"
    manifest = fake_bundle(out)
    manifest["expects"] = {"python": ".".join(map(str, sys.version_info[:2])),
                           "torch": ".".join(torch.__version__.split(".")[:2]),
                           "cuda": str(torch.version.cuda)}  # this machine's, to get past
    for path in out.rglob("manifest.json"):
        path.write_text(json.dumps(manifest))
    carried = carry(out, tmp_path / "tree", [1])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stub'\n")
    (bin_dir / "python").write_text(
        "#!/bin/sh\ncase \"$*\" in *'import vllm'*) exit 1;; *torch.cuda*) echo stub; "
        f"exit 0;; esac\necho \"$*\" >> {calls}\nexec {sys.executable} \"$@\"\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "o"),
           "PYTHON": str(bin_dir / "python"), "BUNDLE_DIR": str(carried),
           "BUNDLE_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == stage.MISSING, done.stdout + done.stderr
    log = (tmp_path / "o" / "gpu_check.log").read_text()
    second = manifest["commands"][1]
    assert f"{second['parts'][0]}: brought by command 2 (carry {second['carry']})" in log
    assert "run the next command within 30 s" in log
    assert "setup.py" not in calls.read_text()  # nothing built
    assert sorted(p.name for p in (tmp_path / "work" / "parts").iterdir()) == sorted(
        manifest["commands"][0]["parts"])


def test_a_command_carries_the_parts_beside_the_working_tree() -> None:
    """By default a command's parts leave room for what travels with every command (the
    files git tracks or does not ignore) within the 64 MiB a command carries."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    tree = sum((REPO / n).stat().st_size for n in listed if n and (REPO / n).is_file())
    mib = gpu_bundle.default_command_mib()
    assert mib == int(mib) and 0 < mib * MIB + tree <= (64 - 4) * MIB
    assert mib * MIB + tree > (64 - 4 - 1) * MIB  # no more than one MiB given away
