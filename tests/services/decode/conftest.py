"""The decode tests reuse the worker mesh of tests/services/common/test_workers.py (imported as
`test_workers`, as pytest does when it collects that folder), so they also run on their own."""

from __future__ import annotations

import sys
from pathlib import Path

_COMMON = str(Path(__file__).resolve().parents[1] / "common")
if _COMMON not in sys.path:
    sys.path.append(_COMMON)
