"""Training data available offline on every machine: the Python standard library's own source.

`stdlib_sources()` lists the library's `.py` files (tests, bundled packages, GUI code, codec
tables and generated data left out) in a stable order; `split()` assigns each file to train or
held-out by a hash of its relative path (deterministic, independent of the file list);
`TokenStream` holds a split tokenized as one stream (BOS + file + EOS per file) and cuts training
windows (seeded by step, so a resumed run sees the same batches) and held-out windows.
Deterministic for a given Python version (recorded in the model card).
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from pdmesh.tools.tokenizer_train import EOS_ID

SKIPPED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "lib2to3",
        "idlelib",
        "turtledemo",
        "tkinter",
        "ensurepip",
        "pydoc_data",
        "encodings",
    }
)
HELD_OUT_EVERY = 20  # one file in 20 (by path hash) is held out


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to the library root, with "/" separators
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[SourceFile]:
    """The library's Python sources, sorted by relative path (undecodable files skipped)."""
    root = root or stdlib_root()
    files: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIPPED_DIRS or rel.parts[0].startswith("config-"):
            continue
        try:
            files.append(SourceFile(rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return files


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_EVERY == 0


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) by `is_held_out` of each file's name."""
    return [f for f in files if not is_held_out(f.name)], [f for f in files if is_held_out(f.name)]


class TokenStream:
    """A split as one token stream: BOS, the file's tokens, EOS, for every file in order
    (`tokenizer`: a tokenizer from `tokenizer_train.train_bpe`)."""

    def __init__(self, files: list[SourceFile], tokenizer: Tokenizer) -> None:
        ids: list[int] = []
        for encoding in tokenizer.encode_batch([f.text for f in files]):
            ids += encoding.ids  # BOS first (the tokenizer's post-processor)
            ids.append(EOS_ID)
        self.tokens = torch.tensor(ids, dtype=torch.long)
        self.num_files = len(files)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] windows at random offsets, a function of (seed, step)."""
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"the stream has {len(self.tokens)} tokens, too few for {seq_len}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=gen)
        return torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])

    def windows(self, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
        """Consecutive non-overlapping [seq_len + 1] windows from the start (evaluation)."""
        out = []
        for start in range(0, len(self.tokens) - seq_len - 1, seq_len):
            if len(out) * seq_len >= max_tokens:
                break
            out.append(self.tokens[start : start + seq_len + 1])
        return out
