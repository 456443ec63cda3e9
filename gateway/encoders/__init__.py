"""The gateway's `Encoder`s that are not the in-process one: encoder worker processes over Redis,
and the pass-through of a gateway whose upstream encodes images itself.
"""
