"""One spelling, one shape per flag (issue 40): a flag several subcommands take is read the same way in each."""
import argparse

from fuzzshard.cli import _parser


def _shared_flags() -> dict:
    """{flag: [(command, action)]} for the flags more than one subcommand shows (old spellings are hidden)."""
    sub = next(a for a in _parser()._actions if a.dest == "command")
    out: dict = {}
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction):
                for flag in a.option_strings:
                    out.setdefault(flag, []).append((name, a))
    return {f: v for f, v in out.items() if len(v) > 1}


def test_a_flag_several_commands_take_has_one_shape_and_each_says_its_default():
    """The same metavar, type, choices, nargs and action wherever it appears (its default may differ: --seed,
    --target, --world-sizes; docs/cli.md says why), and every one has help."""
    shared = _shared_flags()
    assert {"--target", "--seed", "--world-sizes", "--max-examples", "--out", "--device"} <= set(shared)
    for flag, uses in shared.items():
        shapes = {(a.metavar, getattr(a.type, "__name__", a.type), tuple(a.choices or ()), a.nargs, type(a).__name__)
                  for _, a in uses}
        assert len(shapes) == 1, (flag, [(c, a.metavar, a.type, a.choices, a.nargs, type(a).__name__) for c, a in uses])
        assert all(a.help for _, a in uses), flag
    for flag in ("--seed", "--target"):  # their defaults differ by command: each help says its own
        for command, a in shared[flag]:
            assert "default" in a.help, (flag, command)
