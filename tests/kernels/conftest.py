"""Kernel tests run the Triton kernels under the Triton interpreter on CPU tensors.

`@triton.jit` (and triton.language's own jit helpers) choose the interpreter when they are
decorated, so TRITON_INTERPRET=1 must be set before triton is first imported; a test run that
imports triton earlier (e.g. through pdmesh.kernels from another test folder) must set it in a
conftest that is loaded sooner, such as tests/conftest.py.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
