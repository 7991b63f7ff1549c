"""Model definitions, one package per family, beside what they share:

rope       rotary tables (default, YaRN)
experts    routed-expert compute over a layer's slots
moe        routing, expert placement, dispatch (DeepSeekMoE; V3's router)
deepseek_v3/   MLA: attention metadata → layers → model → cpu_path (the C layer path)
deepseek_v4/   config → kv → blocks (mHC, MoE) → attention (window, CSA, HCA) → model → runtime
"""
