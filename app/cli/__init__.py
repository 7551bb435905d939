"""The `inferq` command line: runs the parts, supervises `inferq up`, shows `inferq status`."""
