"""Who calls: API keys, made, looked up and revoked (``keys``).

May import: the ground only.
"""
