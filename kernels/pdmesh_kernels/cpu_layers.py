"""DeepSeek-V3 decoder layers for a few tokens on CPU in one C call (`cpu/layers.c`).

At one user a decode step of the torch path is ~100 small ops per layer, each paying Python and
dispatch overhead that is larger than its arithmetic. `cpu/layers.c` runs whole layers (MLA over
the paged latent cache, routing, experts, shared experts) with no Python in between: the batch's
tensors and the weights go in as pointers, threads by OpenMP (the runtime torch already loaded, so
the two share one thread pool). Two builds of the one source: fp32 weights and KV cache, or bf16
weights and KV cache (`-DPD_BF16`); activations and sums are fp32 in both, except that a bf16
build on a CPU with AVX512-BF16 rounds the inputs of its products to bf16 for native dot products
(fp32 sums).

The library is compiled on first use with the system C compiler (`$CC`, else `cc`; -O3
-march=native -fopenmp) into a cache folder (`$PDMESH_KERNEL_CACHE`, else
`~/.cache/pdmesh/kernels`), keyed by the source, the flags, the compiler and the CPU. Where there is
no compiler (a container image's runtime stage) the library comes from a prebuilt folder
(`$PDMESH_KERNEL_PREBUILT`, else `cpu/prebuilt/` beside the source) that `prebuild` fills at image
build time: one build per dtype and x86-64 micro-architecture level (v4: AVX-512, v3: AVX2 and FMA,
v2), of which the best level this CPU runs is loaded. With neither, `library()` returns None and the
engine keeps its torch path; `PDMESH_CPU_LAYERS=0` turns the C path off.

    python -m pdmesh_kernels.cpu_layers --prebuild [DIR]   # the prebuilt folder (image builds)

Weights go in the layouts the products read fastest, made once at load: the linear weights, each
routed expert's w13 and w2 and each head's absorbed slices (w_uk, w_uv) as 16-column panels
(`pack`, `pack_into`; of row pairs where the build has dot products), in both builds; the routers
too in the fp32 build (the bf16 build keeps them fp32 and reads them as they are).

The ctypes mirrors `Dims` and `Layer` must match `pd_dims` and `pd_layer` in `cpu/layers.c` field
for field.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import cast

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "layers.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-Wall")
# the element types a build stores its weights and KV cache in, and the flags that select them
DTYPE_FLAGS = {torch.float32: (), torch.bfloat16: ("-DPD_BF16",)}
_f32 = ctypes.POINTER(ctypes.c_float)
_i64 = ctypes.POINTER(ctypes.c_int64)
_i32 = ctypes.POINTER(ctypes.c_int32)


class Dims(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "hidden", "num_heads", "q_lora_rank", "kv_lora_rank", "rope_dim", "nope_dim", "v_dim",
            "n_experts", "top_k", "n_group", "topk_group", "norm_topk_prob",
            "block_size", "rope_interleave", "num_threads",
        )),
        *((name, ctypes.c_float) for name in (
            "rms_eps", "latent_eps", "attn_scale", "routed_scaling"
        )),
    ]  # fmt: skip


_w = ctypes.c_void_p  # a weight: fp32 or bf16, the build's element type (`weights`)


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _f32), ("post_norm", _f32), ("q_a", _w), ("q_a_norm", _f32), ("q_b", _w),
        ("q_proj", _w), ("kv_a", _w), ("kv_a_norm", _f32), ("w_uk", _w), ("w_uv", _w),
        ("kv_b", _w), ("o_proj", _w), ("q_a_bias", _f32), ("kv_a_bias", _f32), ("o_bias", _f32),
        ("mlp_width", ctypes.c_int64),
        ("gate", _w), ("up", _w), ("down", _w),
        *((name, ctypes.c_int64) for name in ("moe_index", "moe_width", "num_slots")),
        ("router", _f32), ("router_bias", _f32), ("w13", _w), ("w2", _w),
        ("replicas", _i64),
        ("replica_counts", _i64),
        ("replicas_width", ctypes.c_int64),
    ]  # fmt: skip


def enabled() -> bool:
    return os.environ.get("PDMESH_CPU_LAYERS", "1") not in ("0", "false", "no", "off")


def f32(tensor: torch.Tensor | None) -> ctypes._Pointer[ctypes.c_float] | None:
    """A float pointer to a contiguous fp32 CPU tensor (None stays NULL)."""
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(f"expected an fp32 CPU tensor, got {tensor.dtype} on {tensor.device}")
    return ctypes.cast(tensor.data_ptr(), _f32)


def weights(tensor: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    """The address of a contiguous CPU tensor of the build's element type `dtype` (None: NULL)."""
    if tensor is None:
        return None
    if tensor.dtype != dtype or tensor.device.type != "cpu":
        raise ValueError(f"expected a {dtype} CPU tensor, got {tensor.dtype} on {tensor.device}")
    return tensor.data_ptr()


def i64(tensor: torch.Tensor | None) -> ctypes._Pointer[ctypes.c_int64] | None:
    return None if tensor is None else ctypes.cast(tensor.data_ptr(), _i64)


def i32(tensor: torch.Tensor) -> ctypes._Pointer[ctypes.c_int32]:
    return ctypes.cast(tensor.data_ptr(), _i32)


# x86-64 micro-architecture levels a prebuilt library is compiled for (`-march=`), best first, with
# the /proc/cpuinfo flags each needs (the psABI's lists, less the flags every level-2 CPU has)
LEVELS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"),
    "x86-64-v3": ("avx2", "avx", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"),
    "x86-64-v2": ("sse4_2", "sse4_1", "ssse3", "popcnt", "cx16"),
}


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("PDMESH_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pdmesh" / "kernels"


def _prebuilt_dir() -> Path:
    root = os.environ.get("PDMESH_KERNEL_PREBUILT")
    return Path(root) if root else SOURCE.parent / "prebuilt"


def _source_key() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _prebuilt_name(dtype: torch.dtype, level: str) -> str:
    """A prebuilt library's file name: its dtype, level and source (a stale build is not used)."""
    return f"pdmesh_layers-{str(dtype).removeprefix('torch.')}-{level}-{_source_key()}.so"


def build(compiler: str, dtype: torch.dtype = torch.float32) -> Path:
    """Compile `cpu/layers.c` for weights and KV cache in `dtype` (once per source, flags, compiler
    and CPU) and return the library's path. Raises RuntimeError with the compiler's output when it
    fails."""
    flags = (*FLAGS, *DTYPE_FLAGS[dtype])
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        b"\0".join(
            s.encode() for s in (SOURCE.read_text(), " ".join(flags), version, _cpu_signature())
        )
    ).hexdigest()[:16]
    name = str(dtype).removeprefix("torch.")
    target = _cache_dir() / f"pdmesh_layers-{name}-{key}.so"
    if not target.exists():
        _compile(compiler, flags, target)
    return target


def prebuild(compiler: str, folder: Path | None = None) -> list[Path]:
    """Compile every dtype at every micro-architecture level into `folder` (the prebuilt folder by
    default) for a machine without a compiler; the paths written."""
    folder = folder or _prebuilt_dir()
    built = []
    for dtype, dtype_flags in DTYPE_FLAGS.items():
        for level in LEVELS:
            flags = tuple(f"-march={level}" if f == "-march=native" else f for f in FLAGS)
            target = folder / _prebuilt_name(dtype, level)
            _compile(compiler, (*flags, *dtype_flags), target)
            built.append(target)
    return built


def prebuilt(dtype: torch.dtype, flags: str | None = None) -> Path | None:
    """The prebuilt library of `dtype` at the best level this CPU runs (its /proc/cpuinfo `flags`
    line by default), or None."""
    have = set((flags if flags is not None else _cpu_signature()).split())
    for level, needs in LEVELS.items():
        path = _prebuilt_dir() / _prebuilt_name(dtype, level)
        if have.issuperset(needs) and path.exists():
            return path
    return None


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU layer kernel into %s", target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *flags, "-o", str(out), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr[-4000:]}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file


def library(dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The kernel for weights and KV cache in `dtype` (fp32 or bf16; built on first use), or None:
    disabled (`PDMESH_CPU_LAYERS=0`, read at every call), another dtype, no compiler, or the build
    failed (logged once)."""
    return _library(dtype) if enabled() and dtype in DTYPE_FLAGS else None


@cache
def _library(dtype: torch.dtype) -> ctypes.CDLL | None:
    compiler = _compiler()
    path = None if compiler else prebuilt(dtype)
    if compiler is None and path is None:
        log.warning(
            "no C compiler and no prebuilt library: the CPU layer kernel is off (torch path)"
        )
        return None
    try:
        lib = ctypes.CDLL(str(path or build(cast(str, compiler), dtype)))
    except (OSError, RuntimeError) as exc:
        log.warning("the CPU layer kernel is off (torch path): %s", exc)
        return None
    lib.origin = f"prebuilt {path.name}" if path else f"compiled here by {compiler}"
    lib.pd_forward_layers.restype = ctypes.c_int
    lib.pd_forward_layers.argtypes = [
        ctypes.POINTER(Dims), ctypes.POINTER(Layer), ctypes.c_int64, _f32, ctypes.c_int64,
        _i64, _i64, _i64, _i32, ctypes.c_int64, _f32, _f32, _w, ctypes.c_int64, _i64, _f32,
    ]  # fmt: skip
    lib.pd_panels_size.restype = ctypes.c_int64
    lib.pd_panels_size.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.pd_pack.restype = None
    lib.pd_pack.argtypes = [_w, ctypes.c_int64, ctypes.c_int64, _w]
    lib.pd_matmul.restype = ctypes.c_int
    lib.pd_matmul.argtypes = [
        _f32,
        _f32,
        _w,
        _f32,
        *(ctypes.c_int64,) * 4,
        _f32,
        _f32,
        ctypes.c_float,
    ]
    lib.dtype = dtype
    return lib


@dataclass(frozen=True)
class Packed:
    """A dense weight W [k, n] in the layout the build's products read (`pack`)."""

    data: torch.Tensor
    k: int
    n: int


def pack(lib: ctypes.CDLL, w: torch.Tensor) -> Packed:
    """A linear weight w [k, n] ([in, out], contiguous) packed into the build's panels (a copy,
    `pd_pack`), or w itself where it is not of the build's dtype (the bf16 build's fp32 routers,
    which it reads row-major)."""
    k, n = w.shape
    if w.dtype != lib.dtype:
        return Packed(w, k, n)
    out = torch.empty(lib.pd_panels_size(k, n), dtype=w.dtype)
    pack_into(lib, w, out)
    return Packed(out, k, n)


def pack_into(lib: ctypes.CDLL, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = w [k, n] ([in, out], contiguous, the build's dtype) in 16-column panels (`pd_pack`),
    `out` holding `lib.pd_panels_size(k, n)` elements (a weight, or an expert's slot in a table)."""
    k, n = w.shape
    weights(w, lib.dtype)
    if not w.is_contiguous() or out.numel() != lib.pd_panels_size(k, n) or not out.is_contiguous():
        raise ValueError("pack_into needs a contiguous [k, n] weight and a buffer of its size")
    lib.pd_pack(w.data_ptr(), k, n, weights(out, lib.dtype))


def matmul(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    w: Packed,
    num_threads: int,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    x2: torch.Tensor | None = None,
    norm2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, k] fp32 @ w [k, n] (`pack`ed) -> [T, n] fp32, contiguous CPU tensors (the C
    products, which stay bound by reading w at a few rows where a BLAS GEMM of that shape is not).
    With `norm` [k] each row of x is RMS-normed first (`eps`); with `x2` [T, k/2] and `norm2` the
    input is cat(rms_norm(x) * norm, rms_norm(x2) * norm2) (x then [T, k/2])."""
    rows, k = x.shape[0], w.k
    width = k // 2 if x2 is not None else k
    if not x.is_contiguous() or x.shape[1] != width:
        raise ValueError(f"matmul needs contiguous [T, k] @ [k, n]: {tuple(x.shape)} @ {(k, w.n)}")
    if x2 is not None and (
        norm is None or norm2 is None or x2.shape != x.shape or not x2.is_contiguous()
    ):
        raise ValueError("a joined input needs both norms and a second input shaped like the first")
    y = torch.empty(rows, w.n, dtype=torch.float32)
    status = lib.pd_matmul(
        f32(x), f32(x2), weights(w.data, lib.dtype), f32(y), rows, k, w.n, num_threads,
        f32(norm), f32(norm2), eps,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the CPU matmul could not allocate its work buffer")
    return y


def forward_layers(
    lib: ctypes.CDLL,
    dims: Dims,
    layers: ctypes.Array[Layer],
    x: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_seq: torch.Tensor,
    block_tables: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    kv_caches: torch.Tensor,
    load_counts: torch.Tensor | None = None,
    final_norm: torch.Tensor | None = None,
) -> None:
    """Run `layers` over x [T, D] (fp32, contiguous, updated in place), then `final_norm`'s
    RMSNorm weight [D] if given. positions, slot_mapping, token_seq (each token's row of
    block_tables) [T] int64; block_tables [B, M] int32; rope tables [max_pos, R] fp32; kv_caches
    [len(layers), num_blocks, block_size, L + R] in the library's dtype (layer i uses row i);
    load_counts [num_moe_layers, P] int64 (tokens routed to each slot are added there) or None."""
    for tensor in (x, positions, slot_mapping, token_seq, block_tables, kv_caches):
        if tensor.device.type != "cpu":
            raise ValueError("forward_layers runs on CPU tensors")
        if not tensor.is_contiguous():
            raise ValueError("forward_layers needs contiguous tensors")
    status = lib.pd_forward_layers(
        ctypes.byref(dims),
        layers,
        len(layers),
        f32(x),
        x.shape[0],
        i64(positions),
        i64(slot_mapping),
        i64(token_seq),
        i32(block_tables),
        block_tables.shape[1],
        f32(rope_cos),
        f32(rope_sin),
        weights(kv_caches, lib.dtype),
        kv_caches[0].numel(),
        i64(load_counts),
        f32(final_norm),
    )
    if status != 0:
        raise MemoryError("the CPU layer kernel could not allocate its work buffers")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pdmesh_kernels.cpu_layers")
    parser.add_argument(
        "--prebuild",
        nargs="?",
        const="",
        metavar="DIR",
        required=True,
        help="compile every dtype and micro-architecture level into DIR (default: the prebuilt "
        "folder beside the source, where a machine without a compiler looks)",
    )
    args = parser.parse_args(argv)
    compiler = _compiler()
    if compiler is None:
        parser.error("no C compiler ($CC, cc or gcc) on PATH")
    for path in prebuild(compiler, Path(args.prebuild) if args.prebuild else None):
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
