"""What every transport shares on the wire: error codes and their HTTP statuses (`errors`), the
timing and cache report of a response (`report`) and the WebSocket subprotocols (`subprotocols`).
"""
