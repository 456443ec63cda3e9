"""Small random-weight VLM checkpoints built with transformers' own classes (nothing downloaded).

One module per family (`llava`, `idefics3`, `qwen2_5_vl`), each with
`build(target: Path, *, seed: int = 0) -> Path` that saves config, safetensors weights,
tokenizer (the embedded SmolLM2 tokenizer plus the family's special tokens), image processor
and chat template into `target` and returns it.
"""
