"""Training DeepSeek-V3 presets (`pdmesh model train`):

stdlib sources (data: split, tokenizer, TokenStream) -> DeepseekV3ForTraining (model) ->
Trainer steps, evaluations, resumable state (trainer) -> Hugging Face checkpoint (export)
+ training.json, loss curve, model card (report)
"""
