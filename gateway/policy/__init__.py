"""Edge policy: who a caller is (API keys), how much they may ask (rate limits, the body guard) and
fair shares of shared queues.
"""
