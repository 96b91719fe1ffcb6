"""Bad input gets one clear line and exit code 2; show and --help teach."""
import json
import re

from conftest import run_cli
from cases import simple_case


def _one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and re.match(r"fuzzshard( [a-z]+)?: error: ", lines[-1]), r.stderr
    assert all(w in lines[-1] for w in words), lines[-1]


def test_corrupt_repro_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"case": {"target": "dtensor", "world_size": ')
    _one_line_error(run_cli("replay", bad), "not valid JSON")
    _one_line_error(run_cli("show", bad), "not valid JSON")
    _one_line_error(run_cli("replay", tmp_path / "missing.json"), "cannot read")
    case = tmp_path / "case.json"  # a bare case: show and script take it, upstream wants a finding
    case.write_text(simple_case(2).to_json())
    assert run_cli("show", case).returncode == 0
    _one_line_error(run_cli("upstream", case), "case without a verdict", "fuzzshard replay")


def test_unknown_target():
    _one_line_error(run_cli("fuzz", "--target", "nope", "--max-examples", 1), "unknown target", "nope")


def test_unknown_model_family():
    _one_line_error(run_cli("fuzz", "--models", "decoder,gpt", "--max-examples", 1), "unknown model family", "gpt")
    _one_line_error(run_cli("bench", "--models", "llama"), "unknown model family", "llama")
    _one_line_error(run_cli("fuzz", "--target", "dtensor", "--compile", "--max-examples", 1), "--compile", "fsdp2")


def test_impossible_world_sizes(tmp_path):
    _one_line_error(run_cli("fuzz", "--world-sizes", "0", "--max-examples", 1), "world sizes must be >= 1")
    _one_line_error(run_cli("fuzz", "--world-sizes", "two", "--max-examples", 1), "comma-separated integers")
    case = json.loads(simple_case(2).to_json())
    case["world_size"] = 0
    f = tmp_path / "zero.json"
    f.write_text(json.dumps({"case": case}))
    _one_line_error(run_cli("replay", f), "impossible")


def test_bad_duration_and_missing_setup_file():
    _one_line_error(run_cli("fuzz", "--duration", "ten minutes"), "cannot read duration")
    _one_line_error(run_cli("fuzz", "--max-examples", 1, "--worker-setup", "/no/such/file.py"), "no such file")


def test_show_prints_the_case_readably(tmp_path):
    f = tmp_path / "case.json"
    f.write_text(simple_case(3).to_json())
    r = run_cli("show", f)
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
    r = run_cli("fuzz", "--targets", "nope", "--max-examples", 1)
    assert "--targets is now --target" in r.stderr
    _one_line_error(r, "unknown target", "nope")  # read as --target
    r = run_cli("soak", "--target", "nope", "--duration", "1s", "--out", tmp_path / "s")
    _one_line_error(r, "unknown target", "nope")


def test_a_path_that_cannot_be_written_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    _one_line_error(run_cli("fuzz", "--max-examples", 1, "--out", afile / "out"), "--out", "Not a directory")
    _one_line_error(run_cli("script", simple_case_file(tmp_path), "-o", afile / "x.py"), "Not a directory")


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
    _one_line_error(run_cli("known", "--sample", 2), "--sample goes with --check")
    _one_line_error(run_cli("known", "--json", "x.json"), "--json goes with --check")
    _one_line_error(run_cli("fuzz", "--loop", "clip,warp", "--max-examples", 1), "--loop", "warp", "lr_scheduler")
