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

DSML = "｜DSML｜"  # DeepSeek-V4's tool-call markup (its chat template's `dsml_token`)
# the system prompt's tools section: DeepSeek-V4's, less its thinking-mode paragraphs
TOOLS_HEADER = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    f'invoke tools by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f'<{DSML}tool_calls>\n<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f'</{DSML}parameter>\n...\n</{DSML}invoke>\n<{DSML}invoke name="$TOOL_NAME2">\n...\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n### Available Tool Schemas\n\n'
)
TOOLS_FOOTER = (
    "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)


def _jinja_string(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


# DeepSeek-V3's chat format: BOS, system prompts, then <｜User｜>... /
# <｜Assistant｜>...<｜end▁of▁sentence｜>; with DeepSeek-V4's tools: the tool schemas in the
# system prompt (one JSON line each), tool results as <｜User｜><tool_result>...</tool_result>
# (consecutive ones joined by a blank line), an assistant's calls as a DSML block before its end
# (non-string arguments as compact JSON: the form a grammar-forced call is generated in).
# Conversations without tools render as they did before tools were added (the models were
# trained on them).
DEEPSEEK_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='', after_tool=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] if ns.system == '' else '\\n\\n' + "
    "message['content']) %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if tools %}"
    "{% set ns.system = ns.system + ('' if ns.system == '' else '\\n\\n') + "
    + _jinja_string(TOOLS_HEADER)
    + " %}"
    "{% for tool in tools %}{% if tool['type'] == 'function' %}"
    "{% set ns.system = ns.system + (tool['function'] | tojson) + '\\n' %}"
    "{% endif %}{% endfor %}"
    "{% set ns.system = ns.system + " + _jinja_string(TOOLS_FOOTER) + " %}"
    "{% endif %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ ('\\n\\n' if ns.after_tool else '<｜User｜>') + '<tool_result>' + message['content'] + "
    "'</tool_result>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + (message['content'] or '') }}"
    "{% if message['tool_calls'] %}"
    f"{{{{ '\\n\\n<{DSML}tool_calls>\\n' }}}}"
    "{% for call in message['tool_calls'] %}"
    f"{{{{ '<{DSML}invoke name=\"' + call['function']['name'] + '\">\\n' }}}}"
    "{% for key, value in call['function']['arguments'].items() %}"
    "{% if value is string %}"
    f"{{{{ '<{DSML}parameter name=\"' + key + '\" string=\"true\">' + value + "
    f"'</{DSML}parameter>\\n' }}}}"
    "{% else %}"
    f"{{{{ '<{DSML}parameter name=\"' + key + '\" string=\"false\">' + "
    f"(value | tojson(separators=(',', ':'))) + '</{DSML}parameter>\\n' }}}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if not call['function']['arguments'] %}{{ '\\n' }}{% endif %}"
    f"{{{{ '</{DSML}invoke>\\n' }}}}"
    "{% endfor %}"
    f"{{{{ '</{DSML}tool_calls>' }}}}"
    "{% endif %}"
    "{{ eos_token }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% set ns.after_tool = message['role'] == 'tool' %}"
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
