"""More requests at once than the tiny mesh's pools hold (160 blocks of 8 tokens per rank): none is
lost.

The gateway queues them (per-prefill-rank admission before Reserve, Reserve retried while decode's
pool is short), so every request completes with the offline engine's greedy text, no error reaches a
client, and afterwards no block is held and both pools pass their integrity check.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from meshlib import http_url
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_mesh import _assert_no_leaks, _model_name

NUM_REQUESTS, MAX_TOKENS = 16, 16
# ~210 tokens each: 27 prompt blocks + the output; 16 of them need about three times decode's pool.
PROMPTS = [
    f"Request {i} of {NUM_REQUESTS}: "
    + f"word{i} and another long phrase with token number {i} " * 10
    for i in range(NUM_REQUESTS)
]


def _request_counts(mesh) -> dict[str, float]:
    text = httpx.get(f"{http_url(mesh)}/metrics", timeout=10).text
    return {
        s.labels["status"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "pdmesh_requests"
        for s in family.samples
        if s.name == "pdmesh_requests_total"
    }


def test_a_burst_larger_than_the_pools_loses_no_request(disagg_mesh, tiny_model):
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_model, num_blocks=1024, block_size=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    client = OpenAI(
        base_url=f"{http_url(disagg_mesh)}/v1", api_key="unused", max_retries=0, timeout=120
    )
    before = _request_counts(disagg_mesh)

    def complete(prompt: str):
        return client.completions.create(
            model=_model_name(disagg_mesh),
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        outs = list(pool.map(complete, PROMPTS))
    assert [o.choices[0].text for o in outs] == expected
    assert all(o.usage.completion_tokens == MAX_TOKENS for o in outs)
    after = _request_counts(disagg_mesh)
    changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert changed == {"success": NUM_REQUESTS}, changed
    _assert_no_leaks(disagg_mesh)
