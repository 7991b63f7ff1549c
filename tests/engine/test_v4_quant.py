"""The DeepSeek-V4 release's weight formats (quant.py): the FP8 block and MXFP4 quantisers round
trip (representable values exactly, others within half a step), their bytes are the hand-computed
ones, `iter_v4_tensors` pairs weights with scales wherever they are and refuses a missing or
misshapen scale, and a `pdmesh model init --format official` checkpoint runs in the engine exactly
as its weights dequantised here, independently, and saved in transformers' layout in fp32."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdmesh.tools.model_init import init_model
from pdmesh.tools.model_init_v4 import hf_name, v4_preset_config
from pdmesh_engine import LLM, SamplingParams
from pdmesh_engine.config import CheckpointError
from pdmesh_engine.model.deepseek_v4.config import HCA, V4Config
from pdmesh_engine.model.deepseek_v4.quant import (
    fp8_block_dequantize,
    fp8_block_quantize,
    iter_v4_tensors,
    mxfp4_dequantize,
    mxfp4_quantize,
)
from pdmesh_engine.model.rope import rope_inv_freq


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _ue8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _grow(per_block: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor repeated over rows x cols blocks, cut to `shape`."""
    grown = per_block.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return grown[: shape[0], : shape[1]]


# ----- FP8 e4m3 with ue8m0 block scales -----


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_values_on_the_grid_survive_exactly(block: tuple[int, int]) -> None:
    shape = (200, 300)  # partial blocks on both edges
    codes = torch.randint(0, 256, shape, generator=_gen(), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # e4m3fn's NaNs -> 1.0
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    exponents = torch.randint(-20, 21, grid, generator=_gen()).float()
    x = codes.view(torch.float8_e4m3fn).float() * _grow(torch.exp2(exponents), *block, shape)
    weight, scale = fp8_block_quantize(x, block)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert tuple(scale.shape) == grid
    assert torch.equal(fp8_block_dequantize(weight, scale, torch.float32, block), x)


def test_fp8_error_is_within_half_a_step() -> None:
    spread = torch.exp2(torch.tensor([[-8.0, -4.0], [0.0, 4.0], [8.0, 12.0]]))
    x = torch.randn(260, 150, generator=_gen()) * _grow(spread, 128, 128, (260, 150))
    weight, scale = fp8_block_quantize(x)
    back = fp8_block_dequantize(weight, scale, torch.float32)
    s = _grow(torch.exp2(scale.view(torch.uint8).float() - 127), 128, 128, tuple(x.shape))
    # 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 * s among the subnormals
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10)
    assert ((back - x).abs() <= bound).all()
    assert scale.view(torch.uint8).unique().numel() == 6  # six blocks, six scales


def test_fp8_bytes_are_e4m3_and_the_scale_the_least_power_of_two() -> None:
    x = torch.zeros(128, 256)
    x[0, :4] = torch.tensor([448.0, 1.0, -2.0, 0.5])  # block (0, 0): amax 448 -> 2^0
    x[0, 128:130] = torch.tensor([896.0, -1.0])  # block (0, 1): amax 896 -> 2^1
    weight, scale = fp8_block_quantize(x)
    assert scale.view(torch.uint8).tolist() == [[127, 128]]
    assert weight[0, :4].view(torch.uint8).tolist() == [0x7E, 0x38, 0xC0, 0x30]
    assert weight[0, 128:130].view(torch.uint8).tolist() == [0x7E, 0xB0]  # 448, -0.5
    assert fp8_block_dequantize(weight, scale, torch.float32)[0, 128:130].tolist() == [896, -1]


# ----- MXFP4: e2m1 pairs in bytes, ue8m0 per 32 -----


def test_mxfp4_values_on_the_grid_survive_exactly() -> None:
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.randint(0, 8, (48, 256), generator=_gen())
    signs = torch.randint(0, 2, (48, 256), generator=_gen()) * 2 - 1
    exponents = torch.randint(-30, 31, (48, 8), generator=_gen()).float()
    x = e2m1[codes] * signs * _grow(torch.exp2(exponents), 1, 32, (48, 256))
    packed, scale = mxfp4_quantize(x)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (48, 128)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (48, 8)
    assert torch.equal(mxfp4_dequantize(packed, scale, torch.float32), x)


def test_mxfp4_error_is_within_half_a_step() -> None:
    x = torch.randn(64, 512, generator=_gen()) * torch.logspace(-2, 2, 512)
    packed, scale = mxfp4_quantize(x)
    back = mxfp4_dequantize(packed, scale, torch.float32)
    s = _grow(torch.exp2(scale.view(torch.uint8).float() - 127), 1, 32, (64, 512))
    # steps 0.5 below 2, 1 below 4, 2 up to 6 (times s): half a step <= max(s/4, |x|/4)
    assert ((back - x).abs() <= torch.maximum(s / 4, x.abs() / 4)).all()


def test_mxfp4_packs_element_2i_low_and_2i_plus_1_high() -> None:
    row = torch.zeros(1, 32)
    row[0, :8] = torch.tensor([0.5, -1.0, 6.0, 0.0, 1.5, -6.0, 2.0, -0.5])
    packed, scale = mxfp4_quantize(row)
    # codes 1, 0b1010, 7, 0, 3, 0b1111, 4, 0b1001 (sign bit 3); amax 6 -> scale 2^0
    assert packed.view(torch.uint8)[0, :4].tolist() == [0xA1, 0x07, 0xF3, 0x94]
    assert packed.view(torch.uint8)[0, 4:].tolist() == [0] * 12
    assert scale.view(torch.uint8).tolist() == [[127]]
    hand = torch.tensor([[0xA1, 0x07] + [0] * 14], dtype=torch.uint8).view(torch.int8)
    twice = mxfp4_dequantize(hand, _ue8m0(torch.tensor([[1.0]])), torch.float32)
    assert twice[0, :4].tolist() == [1.0, -2.0, 12.0, 0.0]


# ----- iter_v4_tensors: pairing and errors -----


def test_weights_meet_their_scales_across_shards(tmp_path: Path) -> None:
    x = torch.randn(40, 64, generator=_gen())
    fp8, fp8_scale = fp8_block_quantize(x)
    fp4, fp4_scale = mxfp4_quantize(x)
    save_file({"a.scale": fp8_scale, "e.weight": fp4}, str(tmp_path / "model-1.safetensors"))
    save_file(
        {"a.weight": fp8, "e.scale": fp4_scale, "n.weight": x.bfloat16()},
        str(tmp_path / "model-2.safetensors"),
    )
    got = dict(iter_v4_tensors(tmp_path, torch.float32))
    assert sorted(got) == ["a.weight", "e.weight", "n.weight"]
    assert torch.equal(got["a.weight"], fp8_block_dequantize(fp8, fp8_scale, torch.float32))
    assert torch.equal(got["e.weight"], mxfp4_dequantize(fp4, fp4_scale, torch.float32))
    assert got["n.weight"].dtype == torch.bfloat16  # passed through as stored


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"a.weight": torch.zeros(4, 8).to(torch.float8_e4m3fn)}, "without its scale"),
        (
            {
                "a.weight": torch.zeros(4, 8).to(torch.float8_e4m3fn),
                "a.scale": _ue8m0(torch.zeros(2, 1)),
            },
            r"needs a scale of shape \(1, 1\)",
        ),
        (
            {"e.weight": torch.zeros(4, 16, dtype=torch.int8), "e.scale": _ue8m0(torch.zeros(4))},
            r"MXFP4 weight .* needs a scale of shape \(4, 1\)",
        ),
        (
            {"e.weight": torch.zeros(4, 16, dtype=torch.int8), "e.scale": torch.ones(4, 1)},
            "expected ue8m0",
        ),
        (
            {"e.weight": torch.zeros(16, dtype=torch.int8), "e.scale": _ue8m0(torch.zeros(1))},
            "is 2-D",
        ),
    ],
)
def test_a_missing_or_misshapen_scale_is_refused(
    tmp_path: Path, tensors: dict[str, torch.Tensor], match: str
) -> None:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        list(iter_v4_tensors(tmp_path, torch.float32))


# ----- a `--format official` checkpoint in the engine -----


def _e2m1(code: int) -> float:
    """Sign bit 3, exponent bits 2-1 (bias 1, 0 subnormal), mantissa bit 0."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def _reference_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The release's formats decoded here: e4m3 by torch's cast, e2m1 from its bit fields."""
    scales = scale.view(torch.uint8).double().sub(127).exp2()
    if weight.dtype == torch.float8_e4m3fn:  # the release's 128 x 128 blocks
        return (weight.double() * _grow(scales, 128, 128, tuple(weight.shape))).float()
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    u8 = weight.view(torch.uint8).long()
    values = table[torch.stack((u8 & 15, u8 >> 4), dim=-1).flatten(-2)]
    return (values * _grow(scales, 1, 32, tuple(values.shape))).float()


def _reference_checkpoint(official: Path, out: Path) -> dict[str, torch.Tensor]:
    """The official checkpoint's main model dequantised here, saved fp32 in transformers' layout
    with the same config (less the quantisation) and tokenizer; returns its tensors."""
    out.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(official / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            if name.startswith("mtp.") or name.endswith(".scale"):
                continue
            t = f.get_tensor(name)
            scale = name.removesuffix(".weight") + ".scale"
            if scale in names:
                t = _reference_dequantize(t, f.get_tensor(scale))
            tensors[hf_name(name)] = t if t.dtype == torch.int64 else t.float()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((official / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(official / f, out / f)
    return tensors


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("v4-official")
    path = init_model(
        root / "official", "tiny", seed=5, arch="deepseek_v4", format="official", verbose=False
    )
    return path, root / "reference", _reference_checkpoint(path, root / "reference")


def test_official_checkpoint_stores_the_release_dtypes(official: tuple[Path, Path, dict]) -> None:
    path = official[0]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"  # no scale: BF16
    assert "layers.1.attn.compressor.wkv.scale" not in dtypes
    assert dtypes["layers.1.ffn.experts.7.w2.weight"] == "I8"
    assert dtypes["layers.1.ffn.experts.7.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64" and "layers.0.ffn.gate.bias" not in dtypes
    assert (dtypes["layers.1.ffn.gate.bias"], dtypes["layers.1.attn.attn_sink"]) == ("F32", "F32")
    assert (dtypes["embed.weight"], dtypes["layers.1.attn.kv_norm.weight"]) == ("BF16", "BF16")
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3" and dtypes["mtp.0.hc_head_fn"] == "F32"
    assert dtypes["mtp.0.ffn.experts.0.w1.weight"] == "I8"


def test_release_config_is_the_preset_with_the_release_hca_rate(
    official: tuple[Path, Path, dict],
) -> None:
    release = V4Config.from_dir(official[0])
    preset = V4Config.from_dict(v4_preset_config("tiny", "bfloat16"))
    differ = {"compress_rates", "compress_rope_scaling", "num_nextn_predict_layers"}
    for f in fields(V4Config):
        if f.name not in differ:
            assert getattr(release, f.name) == getattr(preset, f.name), f.name
    assert dict(release.compress_rates)[HCA] == 128 and release.num_nextn_predict_layers == 1
    ours, theirs = rope_inv_freq(release.compress_rope), rope_inv_freq(preset.compress_rope)
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]


def test_the_engine_reads_exactly_the_reference_weights(
    official: tuple[Path, Path, dict],
) -> None:
    path, _, reference = official
    seen = set()
    for name, tensor in iter_v4_tensors(path, torch.float32):
        if name.startswith("mtp."):
            continue
        want = reference[hf_name(name)]
        assert torch.equal(tensor.to(want.dtype), want), name
        seen.add(hf_name(name))
    assert seen == set(reference)


def test_official_checkpoint_generates_as_its_fp32_dequantisation(
    official: tuple[Path, Path, dict],
) -> None:
    path, reference, _ = official
    prompt = torch.randint(2, 1024, (140,), generator=_gen()).tolist()  # past one HCA window
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = [
        LLM(d, dtype="float32").generate({"prompt_ids": prompt}, greedy)[0].token_ids
        for d in (path, reference)
    ]
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) > 1


def test_transformers_loads_the_official_checkpoint_and_the_engine_matches_it(
    official: tuple[Path, Path, dict],
) -> None:
    """transformers dequantises the FP8 and MXFP4 weights itself (on CPU, with accelerate); the
    engine's fp32 logits on the same files equal its within 1e-4."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    path = official[0]
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map="cpu"
    ).eval()
    prompt = torch.randint(2, 1024, (150,), generator=_gen()).tolist()
    with torch.no_grad():
        expected = theirs(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_engine_logits(path, prompt), expected, atol=1e-4, rtol=0)


def _engine_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    from pdmesh_engine.forward_batch import ForwardBatch
    from pdmesh_engine.model.deepseek_v4 import runtime
    from pdmesh_engine.model.deepseek_v4.kv import V4Cache, default_block_size

    config = V4Config.from_dir(path)
    model = runtime.load_model(path, config, torch.device("cpu"), torch.float32)
    size = default_block_size(config)
    blocks = list(range(1, 2 + len(prompt) // size))
    cache = V4Cache(config, 2 + len(blocks), size, torch.float32, torch.device("cpu"))
    batch = ForwardBatch.build([prompt], [0], [blocks], size, [True], torch.device("cpu"))
    with torch.no_grad():
        return model.compute_logits(model(batch, cache))
