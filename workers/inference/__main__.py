"""`inferq worker` runs `python -m workers.inference` (the composition root is main.py).

vLLM's engine process is spawned, and a spawned process re-imports its parent's main module,
except a package's ``__main__``: this one, so the engine process imports none of the worker.
"""

from workers.inference.main import main

if __name__ == "__main__":
    main()
