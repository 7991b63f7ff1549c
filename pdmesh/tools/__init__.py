"""Tools for building test and default checkpoints: seeded random models (`model_init`), the stdlib
text corpus (`corpus`) and BPE tokenizer training (`tokenizer_train`). Not imported by any
service."""
