"""`/v1/responses`: the Responses API's wire shapes and its serving over sessions."""
