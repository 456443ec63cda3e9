"""`/v1/realtime`: the Realtime WebSocket API's wire events, connection, conversation items and
response output.
"""
