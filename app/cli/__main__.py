"""`python -m app.cli`: the `inferq` command."""

from app.cli.main import main

main()
