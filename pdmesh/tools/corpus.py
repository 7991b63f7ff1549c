"""The tokenizer training text: docstrings of standard-library modules, present on every Python.

Run as a script in an isolated interpreter (`python -I -S corpus.py`), it prints the texts as a JSON
list; only the standard library is importable there, so nothing can patch what it reads.
Deterministic for a given Python version.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from typing import Any

# Standard-library modules whose docstrings are the training text (present on every Python).
CORPUS_MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "doctest",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "operator",
    "optparse",
    "pathlib",
    "pprint",
    "random",
    "re",
    "shlex",
    "statistics",
    "string",
    "tarfile",
    "textwrap",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)


def _member_docs(module: Any) -> list[str]:
    docs: list[str] = []
    for attr in sorted(dir(module)):
        obj = getattr(module, attr, None)
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for name, member in sorted(vars(obj).items()):
                func = getattr(member, "fget", None) or getattr(member, "__func__", None) or member
                if name.startswith("_") or not (
                    inspect.isroutine(member) or isinstance(member, property)
                ):
                    continue
                # skip monkeypatched ones
                if getattr(func, "__module__", None) in (None, module.__name__):
                    docs.append(inspect.getdoc(member) or "")
    return [d for d in docs if d]


def gather() -> list[str]:
    """Docstrings of CORPUS_MODULES and their public classes, functions and methods
    (deterministic)."""
    texts: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. typing.io's deprecation, triggered by getattr
        for name in sorted(CORPUS_MODULES):
            module = importlib.import_module(name)
            texts += [inspect.getdoc(module) or ""] + _member_docs(module)
    return [t for t in texts if t]


if __name__ == "__main__":
    sys.stdout.write(json.dumps(gather()))
