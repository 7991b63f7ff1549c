"""Tokenizer: parity with transformers.AutoTokenizer, chat templates, incremental detokenization."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.tools.tokenizer_train import (
    ASSISTANT_TOKEN,
    BOS_ID,
    EOS_ID,
    USER_TOKEN,
    stdlib_corpus,
    tokenizer_config,
    train_tokenizer,
)
from pdmesh_engine.config import CheckpointError
from pdmesh_engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "",
    "  leading and trailing spaces  ",
    "naïve café — 日本語 🙂",
    "def f(x):\n    return x ** 2\n",
    f"{USER_TOKEN}hi{ASSISTANT_TOKEN}",
    "tabs\tand\r\nnewlines 12345",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "naïve 2+2?"},
]


def _write_tokenizer(path: Path, vocab_size: int = 1024, **config_overrides: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(train_tokenizer(vocab_size), encoding="utf-8")
    cfg = {**tokenizer_config(2048), **config_overrides}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "tokenizer_config.json").write_text(
        json.dumps(cfg, ensure_ascii=False), encoding="utf-8"
    )
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def test_special_tokens_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 1024
    assert tok.bos_token_id == BOS_ID == 0
    assert tok.eos_token_ids == (EOS_ID,)
    assert tok.token_to_id(USER_TOKEN) == 2 and tok.token_to_id(ASSISTANT_TOKEN) == 3


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert ids[0] == BOS_ID
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
        text, add_special_tokens=False
    )
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(
        ids, skip_special_tokens=False
    )


@pytest.mark.parametrize("text", [t for t in TEXTS if USER_TOKEN not in t])
def test_decode_roundtrip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=False).startswith(
        "<｜begin▁of▁sentence｜>"
    )


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    """Same text and tokenizer in a fresh process (other hash seed, no transformers monkeypatching
    logging)."""
    pytest.importorskip("transformers")
    here = [
        hashlib.sha256(json.dumps(stdlib_corpus()).encode()).hexdigest(),
        hashlib.sha256(train_tokenizer(1024).encode()).hexdigest(),
    ]
    code = (
        "import hashlib, json; from pdmesh.tools.tokenizer_train import stdlib_corpus, "
        "train_tokenizer; "
        "print(hashlib.sha256(json.dumps(stdlib_corpus()).encode()).hexdigest()); "
        "print(hashlib.sha256(train_tokenizer(1024).encode()).hexdigest())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert other.stdout.split() == here


def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    for gen in (True, False):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert ours == hf_tok.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        )
    text = tok.apply_chat_template(MESSAGES)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>naïve 2+2?<｜Assistant｜>"
    )
    ids = tok.encode_chat(MESSAGES)
    assert (
        ids[0] == BOS_ID and ids.count(BOS_ID) == 1 and ids[-1] == tok.token_to_id(ASSISTANT_TOKEN)
    )
    hf_ids = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unsupported role: narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_default_chat_template_when_none(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_tokenizer(tmp_path, chat_template=None))
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<｜begin▁of▁sentence｜>user: Hi\nassistant: "


def test_chat_template_jinja_file_and_sandbox(tmp_path: Path) -> None:
    d = _write_tokenizer(tmp_path, chat_template=None)
    (d / "chat_template.jinja").write_text("{{ messages | length }}|{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_dir(d).apply_chat_template(MESSAGES)  # the sandbox refuses dunder access


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_bos_prepended_when_post_processor_lacks_it(tmp_path: Path) -> None:
    d = _write_tokenizer(tmp_path)
    raw = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    raw["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")
    tok = Tokenizer.from_dir(d)
    assert tok.encode("Hello")[0] == BOS_ID and tok.encode("Hello").count(BOS_ID) == 1
    assert BOS_ID not in tok.encode("Hello", add_special_tokens=False)


def test_generation_config_eos_ids_are_added(tmp_path: Path) -> None:
    d = _write_tokenizer(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert Tokenizer.from_dir(d).eos_token_ids == (1, 3)


def _stream(tok: Tokenizer, prompt: list[int], out: list[int], rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, i = [], 0
    while i < len(out):
        n = rng.randrange(1, 4)
        deltas.append(detok.push(out[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.output_ids == out and detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize(
    "text", ["naïve café — 日本語 🙂", "🙂🙂 emoji 👩‍👩‍👧 and ünïcödé", "plain ascii text, here."]
)
def test_incremental_detokenizer_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Prompt: ")
    out = tok.encode(text, add_special_tokens=False) + [EOS_ID]
    assert len(out) > len(text.encode()) // 4  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push([i]) for i in out]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(out) == text
    assert detok.flush() == ""


def test_incremental_detokenizer_chunks_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text = "naïve café — 日本語 🙂 " * 3
    out = tok.encode(text, add_special_tokens=False)
    for _ in range(20):
        deltas = _stream(tok, tok.encode("ctx é"), out, rng)
        assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_random_ids(tok: Tokenizer) -> None:
    """Arbitrary ids (invalid UTF-8 included, prompt ending mid-character): the deltas still add
    up."""
    rng = random.Random(1)
    for _ in range(300):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 10))]
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert "".join(_stream(tok, prompt, out, rng)) == tok.decode(out)
