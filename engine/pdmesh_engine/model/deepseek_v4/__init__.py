"""DeepSeek-V4 (V4-Flash, V4.1-Flash): config -> KV layout -> model.

config.py            V4Config from config.json (transformers' or the release's spelling)
kv.py                what is cached per token and per compressed entry; the step's indices
blocks.py            norms, rope, mHC hyper-connections, the MoE
attention.py         window + CSA/HCA attention, compressors, the Lightning Indexer
model.py             the causal LM over a `V4Cache`
checkpoint_names.py  the release's and transformers' tensor names
"""
