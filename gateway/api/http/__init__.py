"""HTTP plumbing shared by the HTTP APIs: body-size bounds, client disconnects and event streams."""
