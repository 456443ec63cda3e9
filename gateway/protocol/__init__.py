"""Wire types: the Realtime WebSocket events (text and image subset) and shared error codes."""
