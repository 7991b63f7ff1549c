"""Training the small byte-level BPE tokenizer of pdmesh's seeded checkpoints, on standard-library
docstrings (`corpus.py`), with DeepSeek-V3's special tokens and chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)  # ids 0, 1, 2, 3
BOS_ID, EOS_ID = 0, 1

# DeepSeek-V3's chat format: BOS, system prompts, then <｜User｜>... /
# <｜Assistant｜>...<｜end▁of▁sentence｜>.
DEEPSEEK_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] if ns.system == '' else '\\n\\n' + "
    "message['content']) %}"
    "{% endif %}"
    "{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def stdlib_corpus() -> list[str]:
    """Docstrings of standard-library modules (see `corpus.py`), gathered in a fresh isolated
    interpreter: what this process imported or patched cannot change the training text."""
    script = Path(__file__).with_name("corpus.py")
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(script)],
        capture_output=True,
        check=True,
        env={"PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"},
    )
    return json.loads(out.stdout.decode("utf-8"))


@lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on `stdlib_corpus()`, as tokenizer.json text."""
    return train_bpe(stdlib_corpus(), vocab_size)


def train_bpe(texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on `texts` (deterministic), as tokenizer.json text.

    Special tokens take ids 0-3 (BOS, EOS, User, Assistant); the post-processor prepends BOS.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("tokenizer training did not give the special tokens ids 0..3")
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained vocabulary {tok.get_vocab_size()} exceeds {vocab_size}")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, BOS_ID)],
            ),
        ]
    )
    return tok.to_str(pretty=True)


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for a tokenizer from `train_tokenizer` (Hugging Face compatible)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": DEEPSEEK_CHAT_TEMPLATE,
    }
