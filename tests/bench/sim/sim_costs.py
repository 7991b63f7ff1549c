"""A hand-made GPU cost file for the simulator's tests: base(t) = 0.009 + 0.001 t seconds, no
attention term, 1 MB/s KV transfer, and overheads that tell the phases apart."""

COSTS = {
    "version": 1,
    "source": "test",
    "model": {"name": "t", "block_size": 16, "kv_bytes_per_token": 1000, "max_model_len": 4096,
              "num_kv_blocks": 4096},
    "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "hardware": {"kind": "gpu"},
    "steps": [{"dep": 1, "tokens": [1, 1001], "seconds": [0.010, 1.010],
               "attn_s_per_token_ctx": 0.0}],
    "kv_transfer": {"latency_s": 0.002, "bytes_per_s": 1e6},
    "overheads": {"request_s": 0.020, "handoff_s": 0.030, "token_s": 0.001},
    "moe": {"share": 0.5, "balancedness": {"eplb": 1.0, "none": 0.5}},
}  # fmt: skip
