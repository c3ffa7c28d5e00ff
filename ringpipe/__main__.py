"""`python -m ringpipe COMMAND ...`: the same as the `ringpipe` command."""
from ringpipe.cli import main

main()
