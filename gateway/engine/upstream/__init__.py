"""The `openai` engine: generation on OpenAI-compatible replicas (vLLM, SGLang, trtllm-serve),
their endpoints, routing and wire.
"""
