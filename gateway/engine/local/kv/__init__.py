"""KV memory of the local engine: `KVMemory` (the one owner of the prefix cache, the byte budget and
the spill store), content-hashed blocks, the automatic prefix cache and the spill stores (memory
and Redis).
"""
