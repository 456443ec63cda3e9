"""`POST /v1/chat/completions`: its wire shapes, messages <-> session items, and its serving."""
