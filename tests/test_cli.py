"""Bad input gets one clear line and exit code 2; show and --help teach."""
import json
import re

from conftest import run_cli
from cases import simple_case


def _cli(*args):
    """`fuzzshard ARGS` in this process: fuzzshard.cli.main(ARGS), what `python -m fuzzshard` exits with, its exit
    code (argparse's SystemExit too), stdout and stderr as run_cli returns them, without a fresh interpreter's
    `import torch` per call (3 to 8 s each on CI's 2 cores: the error tests here took ~130 s). The entry point
    itself stays proven in a subprocess by test_help_teaches_the_commands, test_version_says_... and
    test_script_writes_a_standalone_repro (and every other test's run_cli)."""
    import contextlib
    import io
    import types

    from fuzzshard.cli import main

    argv = [str(a) for a in args]
    if argv and argv[0] in ("fuzz", "soak") and "--loop" not in argv:  # as run_cli
        argv += ["--loop", "none"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's errors: exit 2
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and re.match(r"fuzzshard( [a-z]+)?: error: ", lines[-1]), r.stderr
    assert all(w in lines[-1] for w in words), lines[-1]


def test_corrupt_repro_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"case": {"target": "dtensor", "world_size": ')
    _one_line_error(_cli("replay", bad), "not valid JSON")
    _one_line_error(_cli("show", bad), "not valid JSON")
    _one_line_error(_cli("replay", tmp_path / "missing.json"), "cannot read")
    case = tmp_path / "case.json"  # a bare case: show and script take it, upstream wants a finding
    case.write_text(simple_case(2).to_json())
    assert _cli("show", case).returncode == 0
    _one_line_error(_cli("upstream", case), "case without a verdict", "fuzzshard replay")


def test_unknown_target():
    _one_line_error(_cli("fuzz", "--target", "nope", "--max-examples", 1), "unknown target", "nope")


def test_unknown_model_family():
    _one_line_error(_cli("fuzz", "--models", "decoder,gpt", "--max-examples", 1), "unknown model family", "gpt")
    _one_line_error(_cli("bench", "--models", "llama"), "unknown model family", "llama")
    _one_line_error(_cli("fuzz", "--target", "dtensor", "--compile", "--max-examples", 1), "--compile", "fsdp2")


def test_impossible_world_sizes(tmp_path):
    _one_line_error(_cli("fuzz", "--world-sizes", "0", "--max-examples", 1), "world sizes must be >= 1")
    _one_line_error(_cli("fuzz", "--world-sizes", "two", "--max-examples", 1), "comma-separated integers")
    case = json.loads(simple_case(2).to_json())
    case["world_size"] = 0
    f = tmp_path / "zero.json"
    f.write_text(json.dumps({"case": case}))
    _one_line_error(_cli("replay", f), "impossible")


def test_bad_duration_and_missing_setup_file():
    _one_line_error(_cli("fuzz", "--duration", "ten minutes"), "cannot read duration")
    _one_line_error(_cli("fuzz", "--max-examples", 1, "--worker-setup", "/no/such/file.py"), "no such file")


def test_show_prints_the_case_readably(tmp_path):
    f = tmp_path / "case.json"
    f.write_text(simple_case(3).to_json())
    r = _cli("show", f)
    assert r.returncode == 0, r.stderr
    assert "dtensor on 3 rank(s)" in r.stdout and "Linear(5, 7, bias=True)" in r.stdout
    assert "group 1: layers.2.weight, layers.2.bias" in r.stdout


def test_help_teaches_the_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for word in ("fuzz", "replay", "show", "known", "bench", "torchrun"):
        assert word in r.stdout


def test_every_command_and_positional_says_what_it_is():
    from fuzzshard.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert p.description, f"{name} has no description"
        for a in p._actions:
            assert a.help, f"{name} {a.dest} has no help"  # an old spelling is hidden (SUPPRESS), still named


def test_one_spelling_per_flag_and_the_old_one_still_works_with_a_note(tmp_path):
    r = _cli("fuzz", "--targets", "nope", "--max-examples", 1)
    assert "--targets is now --target" in r.stderr
    _one_line_error(r, "unknown target", "nope")  # read as --target
    r = _cli("soak", "--target", "nope", "--duration", "1s", "--out", tmp_path / "s")
    _one_line_error(r, "unknown target", "nope")


def test_a_path_that_cannot_be_written_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    _one_line_error(_cli("fuzz", "--max-examples", 1, "--out", afile / "out"), "--out", "Not a directory")
    _one_line_error(_cli("script", simple_case_file(tmp_path), "-o", afile / "x.py"), "Not a directory")


def simple_case_file(tmp_path):
    f = tmp_path / "case.json"
    f.write_text(simple_case(2).to_json())
    return f


def test_script_writes_a_standalone_repro(tmp_path):
    f = tmp_path / "case.json"
    f.write_text(simple_case(2).to_json())
    out = tmp_path / "repro.py"
    r = run_cli("script", f, "-o", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    compile(text, str(out), "exec")
    assert "import fuzzshard" not in text and "from fuzzshard" not in text
    assert "torchrun --nproc-per-node 2" in text and "distribute_tensor(" in text  # the straight-line script
    flat = tmp_path / "flat.py"  # --flat: the kernel flattened around the case, as before
    assert run_cli("script", f, "-o", flat, "--flat").returncode == 0 and "CASE_JSON" in flat.read_text()


def test_version_says_fuzzshard_torch_and_python_in_one_line():
    import importlib.metadata
    import platform

    import torch

    import fuzzshard
    from fuzzshard.findings.record import environment

    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"fuzzshard {fuzzshard.__version__}, torch {torch.__version__}, python {platform.python_version()}\n"
    assert fuzzshard.__version__ == importlib.metadata.version("fuzzshard")  # one version: pyproject.toml's
    assert environment(None, "gloo")["fuzzshard"] == fuzzshard.__version__  # every finding file records it


def test_flags_that_go_with_another_say_so_and_unknown_loop_features_are_named():
    _one_line_error(_cli("known", "--sample", 2), "--sample goes with --check")
    _one_line_error(_cli("known", "--json", "x.json"), "--json goes with --check")
    _one_line_error(_cli("fuzz", "--loop", "clip,warp", "--max-examples", 1), "--loop", "warp", "lr_scheduler")


# ---- issue 45: bad input everywhere is one line and exit 2; every ci/ script answers --help

def _parse_error(capsys, *argv) -> str:
    """The one line ``fuzzshard ARGV`` says on stderr where argparse refuses it (exit 2), run in this process."""
    import pytest

    from fuzzshard.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in err, (argv, err)
    return lines[0]


def test_every_flag_whose_value_is_parsed_refuses_a_bad_one_in_one_line_naming_it(capsys):
    import argparse

    from fuzzshard.cli import _parser

    assert _parse_error(capsys, "fuzz", "--max-examples", "x") == \
        "fuzzshard fuzz: error: --max-examples: 'x' is not a whole number"
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    typed = [(name, a) for name, p in sub.choices.items() for a in p._actions if a.type is not None]
    assert len(typed) >= 8, typed  # fuzz, soak, bench, known: every type= flag
    for name, a in typed:
        flag = max(a.option_strings, key=len)
        line = _parse_error(capsys, name, flag, "x")
        assert line.startswith(f"fuzzshard {name}: error: {flag}: 'x' is not"), line
    for argv, says in [(["fuzz", "--max-examples", "0"], "--max-examples: must be at least 1, got 0"),
                       (["fuzz", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
                       (["replay"], "the following arguments are required: file"),
                       (["show", "a.json", "--bogus"], "fuzzshard show: error: unrecognized arguments: --bogus")]:
        assert says in _parse_error(capsys, *argv), argv


def _finding(tmp_path, name, edit):
    from fuzzshard.findings.record import KNOWN_DIR

    data = json.loads((KNOWN_DIR / "dtensor.parity.forward.Conv1d.json").read_text())
    edit(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _set(*keys_value):
    *keys, value = keys_value

    def edit(data):
        for k in keys[:-1]:
            data = data[k]
        if value is _DROP:
            del data[keys[-1]]
        else:
            data[keys[-1]] = value
    return edit


_DROP = object()
# a finding file with something this fuzzshard does not know or cannot read: what its one line says
_BROKEN = {
    "optimizer": (_set("case", "optim", "name", "Adamz"), "unknown optimizer 'Adamz'"),
    "target": (_set("case", "target", "nope"), "unknown target 'nope'"),
    "model_kind": (_set("case", "model", "layers", 0, "kind", "lstm"), "unknown model kind 'lstm' at layers.0"),
    "nested_kind": (_set("case", "model", "layers", 0, "children", 1, "kind", "gru"),
                    "unknown model kind 'gru' at layers.0.1"),
    "dtype": (_set("case", "dtype", "float17"), "unknown dtype 'float17'"),
    "device": (_set("case", "device", "tpu"), "unknown device 'tpu'"),
    "missing_optim": (_set("case", "optim", _DROP), "case: missing field 'optim'"),
    "missing_case": (_set("case", _DROP), "no 'case' field"),
    "missing_signature": (_set("signature", _DROP), "a verdict but no 'signature'"),
    "environment": (_set("environment", [1]), "its 'environment' is not an object"),
    "verdict": (_set("verdict", [1]), "its 'verdict' is not an object"),
    "case_list": (_set("case", [1]), "its 'case' is not an object"),
}


def test_a_finding_file_naming_what_fuzzshard_does_not_know_is_one_clear_error(tmp_path):
    from fuzzshard.cli.common import UsageError, load_file

    for name, (edit, says) in _BROKEN.items():
        path = _finding(tmp_path, name, edit)
        try:
            load_file(path)
        except UsageError as e:
            assert says in str(e) and str(e).startswith(f"{path}: ") and str(e).count(str(path)) == 1, (name, e)
        else:
            raise AssertionError(f"{name}: taken")
    missing = tmp_path / "nope.json"  # the path once, not "nope.json: cannot read nope.json"
    try:
        load_file(missing)
    except UsageError as e:
        assert str(e).count(str(missing)) == 1 and "cannot read" in str(e), e


def test_script_refuses_an_unknown_optimizer_in_one_line_not_a_fallback_script(tmp_path):
    """(It wrote the 4,409-line flattened kernel and exited 0; show, replay and upstream read the file through
    the same load_file, tested above in this process.)"""
    path = _finding(tmp_path, "optimizer", _BROKEN["optimizer"][0])
    r = _cli("script", path)
    _one_line_error(r, "unknown optimizer 'Adamz'", "known: Adam")
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (r.stdout[:300], r.stderr)


def test_every_known_finding_and_case_file_of_the_repository_is_still_taken():
    from fuzzshard.cli.common import load_file
    from fuzzshard.findings.record import KNOWN_DIR

    paths = [p for p in sorted(KNOWN_DIR.glob("*.json")) if p.name != "root_causes.json"]
    assert len(paths) > 100
    for p in paths:
        load_file(p)


def test_the_layer_kinds_a_file_may_name_are_those_the_kernel_builds():
    import pytest

    from fuzzshard.case import Layer
    from fuzzshard.cli.common import LAYER_KINDS
    from fuzzshard.kernel.model import _build

    for kind in LAYER_KINDS:
        _build(Layer(kind, d_in=2, d_out=2, act="relu"))
    with pytest.raises(ValueError):
        _build(Layer("lstm", d_in=2, d_out=2))


def test_the_known_lists_numbers_are_said_in_one_place_and_count_every_root_cause(capsys):
    from fuzzshard.cli import known, main
    from fuzzshard.findings.record import load_known
    from fuzzshard.findings.rootcause import load_root_causes

    findings = load_known()
    causes = load_root_causes(findings)
    head = known.headline(findings, causes)
    ao = sum(1 for rc in causes.values() if rc.component == "torchao")  # torchao's bugs counted apart
    assert ao and head.startswith(f"{len(findings)} known findings (signatures) and {len(causes) - ao} root causes "
                                  f"in torch and {ao} in torchao")
    for rc in causes.values():
        assert (rc.id in head) == (not rc.signatures), rc.id  # one without a finding is named
    assert main(["known"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(head + " (")  # the command's first line
    assert all(f"\n{rid} · " in out for rid in causes)  # and its list: every root cause, with or without findings
    page = known.known_markdown(findings)
    assert known.counts_text(findings, causes) in page and head in page
    assert page.count("\n| `") - page.split("## Root causes", 1)[1].split("\n## ", 1)[1].count("\n| `") \
        == len(causes)  # a row per root cause


def test_script_help_names_every_target_it_writes_straight_line_scripts_for():
    from pathlib import Path

    from fuzzshard import targets
    from fuzzshard.cli import _parser
    from fuzzshard.cli.script import written

    here = Path(__file__).resolve().parent.parent / "fuzzshard" / "scriptgen"
    assert written() == [n for n in targets.names() if (here / f"{n}.py").exists()] and "fsdp1" in written()
    flat = next(a for a in _parser()._subparsers._group_actions[0].choices["script"]._actions if "--flat" in
                a.option_strings)
    assert f"written for {', '.join(written())} cases" in flat.help and "plain fsdp2" not in flat.help


def _ci_scripts():
    from pathlib import Path

    ci = Path(__file__).resolve().parent.parent / "ci"
    return sorted([*ci.glob("*.py"), *ci.rglob("*.sh"), *ci.rglob("*.sbatch")])


def test_every_ci_script_answers_help_with_its_usage_exit_0_and_writes_nothing(tmp_path):
    """--help prints what the script is (its docstring's or leading comment's first words), exits 0 and
    changes nothing: no file of the checkout, nothing in the folder it runs in, its HOME, TMPDIR, VENVS or OUT."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    scripts = _ci_scripts()
    assert len(scripts) >= 12, scripts

    def tree():
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                                text=True).stdout.split("\0")
        return {p: (root / p).stat().st_mtime_ns for p in listed if p and (root / p).is_file()}

    spots = {k: tmp_path / k.lower() for k in ("HOME", "TMPDIR", "VENVS", "OUT", "CWD")}
    for d in spots.values():
        d.mkdir()
    env = {**os.environ, **{k: str(v) for k, v in spots.items() if k != "CWD"}, "PYTHONPATH": str(root),
           "PYTHONDONTWRITEBYTECODE": "1", "FUZZSHARD_CI_VERSIONS": "2.14.1:cached", "DURATION": "1s"}  # (were --help
    # ignored: no venv built, no hour-long soak)
    before = tree()
    runs = {p: subprocess.Popen([sys.executable if p.suffix == ".py" else "bash", str(p), "--help"], cwd=spots["CWD"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in scripts}
    gen = _gen_docs_module()
    for p, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        name = p.relative_to(root)
        assert proc.returncode == 0, (name, proc.returncode, err[-2000:])
        first = " ".join(gen.module_doc(p).split()[:6])
        assert first and first in " ".join(out.split()), (name, first, out[:500])
    assert tree() == before, "a --help changed the checkout"
    left = {k: sorted(os.listdir(d)) for k, d in spots.items() if os.listdir(d)}
    assert not left, f"a --help wrote {left}"


def _gen_docs_module():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gen_docs", Path(__file__).resolve().parent.parent / "ci" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
