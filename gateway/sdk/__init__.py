"""Python clients of the Realtime WebSocket API: `RealtimeClient` (async) and the clients that
resume a dropped connection.
"""
