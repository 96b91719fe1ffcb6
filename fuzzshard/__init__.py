"""fuzzshard: property-based fuzzing of PyTorch's sharded training stacks.

Data flows one way: strategies (Hypothesis) -> Case -> runner (worker pool)
-> kernel (sharded run + anchored reference) -> oracles -> findings.
"""
# the one version (pyproject.toml's, tests/test_cli.py holds them equal); every finding file records it
__version__ = "0.1.0"
