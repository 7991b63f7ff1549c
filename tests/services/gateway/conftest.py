"""Gateway test fixtures: a small trained tokenizer and the model it serves (context CONTEXT)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from pdmesh.tools.tokenizer_train import tokenizer_config, train_tokenizer
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import ModelInfo

CONTEXT = 64  # the served model's context (tests/services/gateway/test_gateway_core.py uses it too)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    cfg = tokenizer_config(CONTEXT)
    return Tokenizer(
        HFTokenizer.from_str(train_tokenizer(512)),
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
        add_bos_token=True,
        chat_template=cfg["chat_template"],
    )


@pytest.fixture(scope="session")
def model(tok: Tokenizer) -> ModelInfo:
    return ModelInfo("tiny", "tiny-dir", CONTEXT, tok.vocab_size, created=1)
