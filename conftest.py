"""Loaded by pytest before any test module: Triton kernels run under the Triton interpreter on
machines without a GPU. `@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so this has
to happen before anything imports triton."""
import os
import shutil

if not shutil.which("nvidia-smi") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
