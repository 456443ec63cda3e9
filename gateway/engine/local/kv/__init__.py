"""KV memory of the local engine: content-hashed blocks, per-session entries (memory and Redis) and
the automatic prefix cache.
"""
