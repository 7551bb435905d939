"""Files (OpenAI's Files API): what a file is, and where its bytes live.

Owns: a file's row, its upload and deletion (``files``); its bytes (``store``).
May import: the ground only.
"""
