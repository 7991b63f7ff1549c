"""DeepSeek-V3 (also R1, Kimi-K2, Moonlight): `attention` (per-step attention metadata, CPU MLA
decode) → `layers` (norms, rope, MLA attention) → `model` (the causal LM, MTP) → `cpu_path` (the
whole decoder as one C call on CPU). Its config is `pdmesh_engine.config.ModelConfig`."""
