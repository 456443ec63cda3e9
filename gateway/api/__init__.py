"""The transports: the Realtime WebSocket API (`realtime`) and the OpenAI-compatible HTTP APIs
(`openai`), over the chat core, and the HTTP plumbing they share (`http`).
"""
