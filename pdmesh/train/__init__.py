"""Training DeepSeek-V3 and DeepSeek-V4 presets (`pdmesh model train [--arch deepseek_v4]`):

stdlib sources (data: split, tokenizer, TokenStream) -> DeepseekV3ForTraining (model) or
DeepseekV4ForTraining (model_v4) -> Trainer steps, evaluations, resumable state (trainer) ->
Hugging Face checkpoint (export) + training.json, loss curve, model card (report)
"""
