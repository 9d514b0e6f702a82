"""csrc/cuda/tree_ops.cu's ops on CPU threads (emulator.h, emulated_ops.cpp)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load() -> ModuleType:
    """Builds (when its sources or flags changed) and imports the emulated ops.

    DDTREE_EMULATOR_CFLAGS adds compiler flags (scripts/check_sanitizers.sh: sanitizers).
    """
    from torch.utils.cpp_extension import load as load_extension

    build = HERE.parent.parent / "build" / "cuda-emulator"
    build.mkdir(parents=True, exist_ok=True)
    extra = os.environ.get("DDTREE_EMULATOR_CFLAGS", "").split()
    saved = dict(os.environ)
    # The compiler must not run under a sanitizer runtime this process is preloaded with,
    # and the build needs ninja, which scripts/setup_env.sh installs beside this Python.
    os.environ.pop("LD_PRELOAD", None)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                          os.environ.get("PATH", "")])
    try:
        return load_extension(
            "ddtree_cuda_emulated", [str(HERE / "emulated_ops.cpp")],
            extra_cflags=["-O2", "-std=c++20", "-D_GLIBCXX_ASSERTIONS", *extra],
            extra_ldflags=[f for f in extra if f.startswith("-fsanitize")],
            build_directory=str(build))
    finally:
        os.environ.clear()
        os.environ.update(saved)
