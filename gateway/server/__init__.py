"""The running gateway: the Litestar app's wiring, its state, readiness, request ids, the uvicorn
runner and the playground's static files.
"""
