"""DeepSeek-V4's release format through llama.cpp's converter: a `pdmesh model init --arch
deepseek_v4 --format official` checkpoint converted to GGUF by the `convert_hf_to_gguf.py` of a
llama.cpp source tree, once for the model (the converter skips `mtp.*`) and once with `--mtp` (the
MTP layer alone); prints each GGUF's tensor count and types, and whether ggml's own MXFP4 decode
(gguf-py) of every repacked expert tensor equals the engine's dequantised experts.

    python -m pdmesh_bench.v4_llamacpp_convert --llama-cpp DIR [--preset tiny] [--seed 0]

DIR holds `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` (the llama-cpp-python sdist's
`vendor/llama.cpp`, for one); nothing is installed, the converter runs with this interpreter (it
needs torch, numpy, transformers, pyyaml, tqdm and requests). One thing of the converter is
replaced: its table of known pre-tokenizers lists released tokenizers by the hash of their output,
and the checkpoint's random byte-level BPE (GPT-2's pre-tokenizer regex) is not among them, so
the lookup answers "gpt-2". The tensors take the converter's own path: the release's names, FP8
weights dequantised with their block scales, MXFP4 experts repacked into GGUF MXFP4 blocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs in a child interpreter: argv = [llama.cpp root, output GGUF, converter arguments...].
_DRIVER = r"""
import collections, json, sys
root, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [root, root + "/gguf-py"]
import convert_hf_to_gguf, gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *args, "--outfile", out]
convert_hf_to_gguf.main()
reader = gguf.GGUFReader(out)
types = collections.Counter(t.tensor_type.name for t in reader.tensors)
report = {"tensors": len(reader.tensors), "types": dict(sorted(types.items()))}
if "--mtp" not in args:  # ggml's MXFP4 decode of the repacked experts == the engine's
    import re, torch
    from gguf.quants import dequantize
    from pdmesh_engine.model.deepseek_v4.quant import iter_v4_tensors
    engine = dict(iter_v4_tensors(args[0], torch.float32))
    part, equal = {"gate": "w1", "up": "w3", "down": "w2"}, []
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", t.name)
        if m:
            p = f"layers.{m[1]}.ffn.experts.{{}}.{part[m[2]]}.weight"
            want = torch.stack([engine[p.format(e)] for e in range(t.shape[-1])])
            got = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
            equal.append(torch.equal(got.reshape(want.shape), want))
    report["mxfp4_experts_equal_engine"] = f"{sum(equal)}/{len(equal)}"
print(json.dumps(report))
"""


def convert(llama_cpp: Path, model_dir: Path, out: Path, extra: list[str]) -> dict[str, object]:
    """Run the converter on `model_dir` into `out` -> {"ok", "seconds", "tensors", "types"} or
    {"ok": False, "seconds", "error": the tail of its output}."""
    argv = [sys.executable, "-c", _DRIVER, str(llama_cpp), str(out), str(model_dir), *extra]
    t0 = time.perf_counter()
    run = subprocess.run(argv, cwd=llama_cpp, capture_output=True, text=True, check=False)
    seconds = round(time.perf_counter() - t0, 1)
    if run.returncode != 0:
        return {"ok": False, "seconds": seconds, "error": (run.stdout + run.stderr)[-3000:]}
    return {"ok": True, "seconds": seconds, **json.loads(run.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = args.llama_cpp.resolve()
    if not (root / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{root} holds no convert_hf_to_gguf.py")
    from pdmesh.tools.model_init import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(
            Path(tmp) / "official",
            args.preset,
            args.seed,
            arch="deepseek_v4",
            format="official",
            verbose=False,
        )
        results = {
            "model": convert(root, model, Path(tmp) / "model.gguf", []),
            "mtp": convert(root, model, Path(tmp) / "mtp.gguf", ["--mtp"]),
        }
    print(json.dumps({"preset": args.preset, "seed": args.seed, **results}, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
