"""The local engine: a transformers model in-process, continuous batching, prompts, sampling and
grammars.
"""
