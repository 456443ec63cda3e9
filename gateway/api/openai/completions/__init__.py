"""The legacy `POST /v1/completions`: plain-text prompts with no chat template."""
