"""Reading a Hugging Face model directory from local disk: generation defaults, safetensors.

The hyper-parameters are `ModelConfig.from_dir` (config.py). Nothing here downloads anything:
`model_dir` is a plain local directory holding `config.json`, one or several `*.safetensors` files
(with `model.safetensors.index.json` when sharded) and optionally `generation_config.json`. Tensors
are streamed one at a time, never a whole file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdmesh_engine.config import DTYPE_NAMES, CheckpointError, read_json

INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json keys passed through as sampling defaults when present.
_GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "do_sample",
    "pad_token_id",
    "bos_token_id",
)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # torch_dtype name -> torch.dtype
# The embedded trained checkpoints (`pdmesh model train`; their cards say how they were made).
EMBEDDED_DIR = Path(__file__).parent / "checkpoints"
DEFAULT_MODEL = "coder-v4"


def embedded_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """An embedded checkpoint: "coder-v4" (DeepSeek-V4), the default model; "coder" (DeepSeek-V3)
    or "coder-draft", coder's draft model."""
    path = EMBEDDED_DIR / name
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path}: the embedded {name!r} checkpoint is not installed (install pdmesh-engine "
            "from the repository, or pass a model directory)"
        )
    return path


def _require_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(
            f"{model_dir}: not a directory (expected a Hugging Face model directory)"
        )
    return path


def find_safetensors(model_dir: str | Path) -> list[Path]:
    """The checkpoint's `*.safetensors` files, in load order.

    With `model.safetensors.index.json` the files are those its `weight_map` names (sorted, each
    once); otherwise every `*.safetensors` file of the directory, sorted by name.
    """
    path = _require_dir(model_dir)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: has no 'weight_map' (tensor name -> file)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: names shard(s) that do not exist in {path}: {missing}"
            )
        return files
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(
            f"{path}: no *.safetensors weights found (only safetensors checkpoints are supported)"
        )
    return files


def iter_tensors(
    model_dir: str | Path, device: str = "cpu", names: Sequence[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` pairs of the checkpoint, one tensor at a time.

    `names`, when given, restricts the stream to those tensors (the rest are not read).
    Tensors come out in file order, then in each file's key order.
    """
    wanted = set(names) if names is not None else None
    for file in find_safetensors(model_dir):
        with _open_safetensors(file, device) as handle:
            for name in handle.keys():
                if wanted is None or name in wanted:
                    yield name, handle.get_tensor(name)


def _open_safetensors(file: Path, device: str = "cpu") -> Any:
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e


def tensor_names(model_dir: str | Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint mapped to the file that holds it (reads headers only)."""
    out: dict[str, Path] = {}
    for file in find_safetensors(model_dir):
        with _open_safetensors(file) as handle:
            for name in handle.keys():
                out[name] = file
    return out


def expect_shape(name: str, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Return `tensor` if its shape is `shape`, else raise CheckpointError naming the tensor."""
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
    return tensor


def _as_id_tuple(value: Any, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise CheckpointError(
            f"{path}: eos_token_id must be an int or a list of ints, got {value!r}"
        )
    return tuple(items)


def load_generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """Generation defaults of the checkpoint as a small dict.

    Always holds `eos_token_ids` (a tuple; from generation_config.json, else config.json, else
    empty); the keys of `_GENERATION_KEYS` are copied from generation_config.json when present.
    """
    path = _require_dir(model_dir)
    gen_path = path / GENERATION_CONFIG_FILE
    raw: dict[str, Any] = {}
    if gen_path.is_file():
        loaded = read_json(gen_path)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{gen_path}: expected a JSON object")
        raw = loaded
    out: dict[str, Any] = {k: raw[k] for k in _GENERATION_KEYS if raw.get(k) is not None}
    eos = _as_id_tuple(raw.get("eos_token_id"), gen_path)
    if not eos and (path / "config.json").is_file():
        config_raw = read_json(path / "config.json")
        if isinstance(config_raw, dict):
            eos = _as_id_tuple(config_raw.get("eos_token_id"), path / "config.json")
    out["eos_token_ids"] = eos
    return out
