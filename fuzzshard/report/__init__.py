"""What a person reads: a session's HTML page, a finding in the terminal, an issue-ready report for PyTorch.

page.py, show.py and upstream.py, in that order."""
