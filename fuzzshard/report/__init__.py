"""What a person reads: the HTML page, a finding in the terminal, a report for PyTorch.

page.py, show.py and upstream.py, in that order."""
