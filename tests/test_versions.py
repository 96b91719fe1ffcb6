"""The supported torch range (fuzzshard/versions.py): the floor refused at start in
one line, the range pyproject states, the API differences the version module
bridges, and the known list's regression table over releases (issue 29). No pool."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from fuzzshard import versions

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version, ok", [("2.8.0", False), ("2.6.0+cu124", False), ("1.13.1", False),
                                         ("2.9.0", True), ("2.13.0+cpu", True), ("2.16.0.dev20260101+cpu", True)])
def test_the_floor_is_one_line_naming_it(version, ok):
    why = versions.too_old(version)
    floor = ".".join(map(str, versions.FLOOR))
    assert (why is None) == ok
    if not ok:
        assert "\n" not in why and version in why and f"torch {floor}" in why


def test_the_cli_refuses_a_torch_below_the_floor_with_exit_2(monkeypatch, capsys):
    from fuzzshard.cli import main

    monkeypatch.setattr(versions, "installed_torch", lambda: "2.8.0")
    assert main(["show", str(ROOT / "fuzzshard/known/dtensor.parity.forward.Conv1d.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "older than fuzzshard's floor" in err[0] and "2.8.0" in err[0], err
    monkeypatch.setattr(versions, "installed_torch", lambda: "2.13.0+cpu")
    assert main(["show", str(ROOT / "fuzzshard/known/dtensor.parity.forward.Conv1d.json")]) == 0


def test_pyproject_states_the_floor_and_the_readme_install_keeps_its_torch():
    """`pip install torch==2.13.0 -e .` must not pull another torch: the requirement is a floor only."""
    text = (ROOT / "pyproject.toml").read_text()
    req = re.search(r'"torch([^"]*)"', text).group(1)
    floor = ".".join(map(str, versions.FLOOR))
    assert req == f">={floor}", req
    assert versions.release("2.13.0") >= versions.FLOOR and "2.13.0" in versions.TESTED


@pytest.mark.parametrize("size, n", [(5, 3), (6, 4), (1, 2), (0, 3), (7, 7), (9, 2)])
def test_shard_size_and_offset_is_torch_chunking(size, n):
    """Shard(d) splits a dim as torch.chunk does, short or empty chunks last."""
    import torch

    chunks = list(torch.arange(size).chunk(n)) if size else []
    want, at = [], 0
    for c in range(n):
        length = len(chunks[c]) if c < len(chunks) else 0
        want.append((length, at if length else min(at, size)))
        at += length
    got = [versions.shard_size_and_offset(size, n, c) for c in range(n)]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got if g[0]] == [w[1] for w in want if w[0]]


def _fake(sig, root, seen):
    from fuzzshard.findings.record import load_known

    f = next(iter(load_known().values()))
    return f.__class__(sig, f.case, f.verdict, root_cause=root, seen_on=seen)


def test_the_regression_table_says_per_root_cause_and_release():
    from fuzzshard.cli.known import regression_table

    known = {"a1": _fake("a1", "bug-a", {"2.10.0": "reproduces", "2.14.1": "fixed"}),
             "a2": _fake("a2", "bug-a", {"2.10.0": "differs (x)", "2.14.1": "fixed"}),
             "b1": _fake("b1", "bug-b", {"2.10.0": "differs (y)"}),
             "c1": _fake("c1", "bug-c", {"2.9.0": "fixed"})}
    rows = regression_table(known, {})
    # releases in release order, not text order
    assert rows[5] == "| root cause | 2.9.0 | 2.10.0 | 2.14.1 | first bad | last good | fixed in |", rows
    table = {r.split(" | ")[0].strip("| `"): r.split(" | ")[1:] for r in rows[7:]}
    assert table["bug-a"] == ["-", "reproduces 1/0/1", "passes 0/2/0", "2.10.0", "-", "**2.14.1** |"]
    assert table["bug-b"] == ["-", "fails otherwise 0/0/1", "-", "-", "-", "- |"]
    assert table["bug-c"][0] == "passes 0/1/0" and table["bug-c"][-1] == "- |"  # a pass before the bug: no fix
    assert regression_table({"c1": _fake("c1", "bug-c", {})}, {}) == []


def test_known_table_records_each_release_in_the_files_and_the_readme(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "ci"))
    import known_table

    known_dir = tmp_path / "known"
    shutil.copytree(ROOT / "fuzzshard/known", known_dir)
    for f in known_dir.glob("*.json"):  # a clean slate: what the real list recorded is not this test's input
        data = json.loads(f.read_text())
        if isinstance(data, dict) and data.pop("seen_on", None) is not None:
            f.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    sig = "dtensor.parity.forward.Conv1d"
    res = {"torch": "2.10.0+cu128", "device": "cpu", "results": {sig: "reproduces", "no.such.sig": "fixed",
                                                                  "dtensor.hang.load.broadcast": "skipped"}}
    assert known_table.record([res], known_dir) == ["2.10.0"]
    data = json.loads((known_dir / f"{sig}.json").read_text())
    assert data["seen_on"] == {"2.10.0": "reproduces"}
    assert "seen_on" not in json.loads((known_dir / "dtensor.hang.load.broadcast.json").read_text())
    known_table.record([{**res, "torch": "2.14.1", "results": {sig: "fixed"}}], known_dir)
    assert json.loads((known_dir / f"{sig}.json").read_text())["seen_on"] == {"2.10.0": "reproduces",
                                                                              "2.14.1": "fixed"}
    readme = (known_dir / "README.md").read_text()
    assert "| root cause | 2.10.0 | 2.14.1 | first bad | last good | fixed in |" in readme
    # 2.14.1 checked this finding alone: the root cause's other findings are no evidence there
    assert "| `dtensor-conv-handlers-skip-redistribution` | reproduces 1/0/0 | passes 0/1/0 | 2.10.0 | - | **2.14.1** |" \
        in readme


def test_known_sample_takes_one_cheap_runnable_finding_per_root_cause():
    """`known --check --sample N` (the version smoke pass): N root causes, one finding each, on at most 2
    ranks of this device, never a hang counted by its trigger (it would run nothing)."""
    from fuzzshard.cli.known import _sample
    from fuzzshard.findings.record import load_known

    known = load_known()
    got = _sample(known, 6, "cpu")
    assert len(got) == 6 and len({f.root_cause for f in got.values()}) == 6
    assert all(f.case.ranks <= 2 and f.case.device == "cpu" and not f.trigger for f in got.values())


def test_a_sharding_propagation_failure_is_named_by_its_op_not_by_the_call_it_dumps():
    """torch 2.9's "Sharding propagation failed for Op(op=aten.index_put_, args_schema=...)" prints the
    call's specs, shapes and a mask's values: one bug gave 6 signatures in a 2.9 session. The op alone
    names it (another op's failure stays another signature)."""
    from fuzzshard.oracle.error_parity import message_digest

    masks = ["Sharding propagation failed for Op(op=aten.index_put_.default, args_schema=Spec(S(0) on (2, 2)), "
             "[DTensor(local_tensor=tensor([[False, False],",
             "Sharding propagation failed for Op(op=aten.index_put_.default, args_schema=Spec(S(0) on (1, 1)), "
             "[DTensor(local_tensor=tensor([[False]]), device_mesh=DeviceMesh((1,), device: 'cpu', stride: (1,)), "
             "placements=(Shard(dim=0),))], Spec(R on ()) @ mesh: (1,))"]
    conv = "Sharding propagation failed for Op(op=aten.convolution.default, args_schema=Spec(R on (2, 5, 1)), " \
           "Spec(S(1) on (3, 5, 1)), None, [1], [0], [1], False, [0], 1 @ mesh: (1,))."
    assert message_digest(masks[0]) == message_digest(masks[1]) != message_digest(conv)


def test_an_op_named_the_cpp_way_is_no_part_of_the_template():
    """torch 2.10 says "found no DeviceMesh from dtensor args for aten::_fused_sgd_" (C++'s aten::X): one
    template for every op, as aten.X always was (4 signatures of one 2.10 bug in a clean session, now 1)."""
    from fuzzshard.oracle.error_parity import message_digest

    said = [f"found no DeviceMesh from dtensor args for aten::{op}" for op in
            ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_foreach_lerp_.ScalarList", "_foreach_copy_")]
    assert len({message_digest(m) for m in said}) == 1
    assert message_digest(said[0]) != message_digest("Cannot find device mesh from args for op : aten::index_put_")
