"""Training DeepSeek-V3 presets (`pdmesh model train`)."""
