"""Code that runs inside the ranks: build the model, train it, record, compare.

Every module here imports only the standard library, torch and its siblings
(``from .x import name``), so ``fuzzshard.findings.repro`` can flatten the exact code
that ran a case into one standalone script.
"""
