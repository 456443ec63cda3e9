"""The chat core, independent of any transport: the request layer, the service that runs one
response over a session, its events, image input and visual tokens, tools and output grammars,
and the response's trace.
"""
