"""`configure_logging`: the engine's standard-library records reach the service's log as JSON
lines at the service's level (the CPU layer path's "on" line is one), other libraries' only from
WARNING."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
from pdmesh_service.logging import configure_logging, get_logger
configure_logging("decode", "INFO")
logging.getLogger("pdmesh_engine.model.deepseek_v3.cpu_path").info("CPU layer path on (%s)", "x")
logging.getLogger("pdmesh_engine.llm").debug("not at INFO")
logging.getLogger("httpx").info("a library's chatter")
logging.getLogger("httpx").warning("a library's warning")
get_logger("pdmesh_decode").info("structlog still renders", n=1)
"""


def test_engine_records_are_json_lines_at_the_services_level() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    events = [(line["level"], line["event"]) for line in lines]
    assert events == [
        ("info", "CPU layer path on (x)"),
        ("warning", "a library's warning"),
        ("info", "structlog still renders"),
    ]
    assert lines[0]["service"] == "decode" and lines[0]["logger"].endswith("cpu_path")
