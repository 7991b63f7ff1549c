"""What every Triton kernel test shares: the skip without triton, the tolerances by dtype, and the
check that a kernel really runs under the interpreter on this CPU machine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdmesh_kernels import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def require_interpreted(kernel: Any) -> None:
    """Fail unless `kernel` (a @triton.jit function) runs in triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py)")
