"""`inferq ops` runs `python -m workers.ops` (the composition root is main.py)."""

from workers.ops.main import main

if __name__ == "__main__":
    main()
