"""``fuzzshard upstream FILE.json``: a finding as an issue for pytorch/pytorch.

The shape of PyTorch's bug template: a title "[Component] what goes wrong",
"### 🐛 Describe the bug" with a standalone script, what it prints, expected
against actual with numbers and the torch source suspected, then
"### Versions". The script is the hand-reduced one in known/minimal/ when the
finding's root cause has one, else the script fuzzshard generates (too long
for an issue body past INLINE_LIMIT: then it is written beside the report as
an attachment). With ``run``, the script runs under torchrun here first and
its output goes into the report, so what is sent is what reproduces today.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from . import oracle, repro
from .findings import Finding, summary
from .oracle.source import link as _link
from .rootcause import Matcher, RootCause

RUN_TIMEOUT = 300  # seconds for the script's run here
INLINE_LIMIT = 40_000  # GitHub refuses an issue body over 65,536 characters
_ROOT = Path(__file__).resolve().parent.parent  # a root cause's minimal script is named from the repository


def report(finding: Finding, known: dict, run: bool = True, attachment: Path | None = None) -> tuple[str, dict]:
    """(markdown, {file name: text} to attach)."""
    case, verdict = finding.case, finding.verdict
    rc = _root_cause(finding, known)
    minimal = rc.minimal if rc and rc.minimal and (_ROOT / rc.minimal).exists() else None
    if minimal:
        text = (_ROOT / minimal).read_text()
        name = Path(minimal).name
        ranks = _ranks_of(text, name)
    else:
        text = repro.script(case, summary(verdict), finding.environment)
        name = attachment.name if attachment and len(text) > INLINE_LIMIT else "repro.py"
        ranks = max(case.ranks, (case.checkpoint.world_size if case.checkpoint else 0) or 0)
    command = f"torchrun --nproc-per-node {ranks} {name}" if ranks else f"python {name}"
    out: list[str] = [f"Title: {title(finding, rc)}", "", "### 🐛 Describe the bug", "", _what(finding, rc), ""]
    attach: dict[str, str] = {}
    if minimal:
        out += [f"A hand-reduced, standalone script (torch only, CPU, gloo): `{command}`", "", "```python",
                text.rstrip(), "```", ""]
    elif len(text) <= INLINE_LIMIT:
        out += [f"A standalone script (torch only; generated from the shrunk case, so it carries the harness "
                f"that builds the model and compares it): `{command}`", "", "<details><summary>" + name +
                f" ({text.count(chr(10))} lines)</summary>", "", "```python", text.rstrip(), "```", "</details>", ""]
    else:
        attach[name] = text
        out += [f"A standalone script is attached as `{name}` ({text.count(chr(10))} "
                "lines, torch only; generated from the shrunk case, so it carries the harness that builds the model "
                f"and compares it; too long for an issue body): `{command}`", ""]
    if run:
        code, printed = _run(text, name, ranks)
        out += [f"Output on torch {_torch()} (exit code {code}):", "", "```", printed.rstrip(), "```", ""]
    out += _expected_actual(finding)
    suspect = suspected_source(finding, rc)
    if suspect:
        out += ["**Suspected source**: " + suspect, ""]
    if rc and rc.upstream and rc.upstream.get("note"):
        out += [f"Related upstream: {rc.upstream['note']}", ""]
    out += [_how_found(finding), "", "### Versions", "", "```", _versions(finding, run).rstrip(), "```", ""]
    return "\n".join(out), attach


def title(finding: Finding, rc: RootCause | None) -> str:
    case, v = finding.case, finding.verdict
    if rc:
        component = _component(rc, case.target)
        words = rc.title.split(" ", 1)  # "[FSDP1] FSDP1 FULL_STATE_DICT ...": the component once
        return f"[{component}] {words[1] if words[0] == component and len(words) > 1 else rc.title}"
    # a new finding: what went wrong, as its oracle says it
    return f"[{_component(None, case.target)}] {oracle.of(v).title(case, v)}"


def suspected_source(finding: Finding, rc: RootCause | None) -> str:
    """"torch/x.py:N (function)" with a link at this torch's tag: the root cause's API where
    one is recorded, else the innermost telling torch frame of an error or a crash, else the
    optimizer implementation a step divergence runs (a guess, and said to be one)."""
    v, case = finding.verdict, finding.case
    if rc and rc.api:
        return _link(rc.api)
    return oracle.of(v).source(case, v)


def _root_cause(finding: Finding, known: dict) -> RootCause | None:
    matcher = Matcher(known)  # (it holds the root causes too)
    rid = finding.root_cause or (known[finding.signature].root_cause if finding.signature in known else "")
    if not rid and finding.verdict:  # a new finding: only a unique match on what identifies the bug
        ids = matcher.suspects(finding.case, finding.verdict)
        rid = ids[0] if len(ids) == 1 else ""
    return matcher.causes.get(rid)


def _component(rc: RootCause | None, target: str) -> str:
    """What the title's [brackets] name: the root cause's component, else the target's (its spec says)."""
    from . import targets

    if rc and rc.component:
        return rc.component
    return (targets.get(target).spec.component if target in targets.names() else "") or target


def _what(finding: Finding, rc: RootCause | None) -> str:
    lines = []
    if rc:
        lines.append(rc.title + ".")
    lines.append(f"fuzzshard's finding `{finding.signature or '(a case file)'}`: {summary(finding.verdict)}")
    if finding.diagnosis and (not rc or finding.diagnosis != rc.title):
        lines.append("")
        lines.append(finding.diagnosis)
    return "\n".join(lines)


def _expected_actual(finding: Finding) -> list[str]:
    return oracle.of(finding.verdict).expected_actual(finding.verdict)


def _how_found(finding: Finding) -> str:
    case = finding.case
    return (f"Found by fuzzshard (property-based differential testing of sharded training): "
            f"a drawn model, optimizer and data trained sharded ({case.target}, world size {case.world_size}, mesh "
            f"{tuple(case.mesh_shape)}) and unsharded, compared after every step; shrunk by Hypothesis and "
            f"confirmed in fresh processes.")


def _versions(finding: Finding, collect: bool) -> str:
    env = finding.environment or {}
    lines = [f"found on: torch {env.get('torch', '?')}, {env.get('device', finding.case.device)}, backend "
             f"{env.get('backend', '?')}, python {env.get('python', '?')}, {env.get('platform', '?')}"]
    import torch

    lines.append(f"this report: torch {torch.__version__} (git {torch.version.git_version[:12]}), python "
                 f"{platform.python_version()}, {platform.platform()}")
    if collect:
        try:
            from torch.utils.collect_env import get_pretty_env_info

            lines += ["", get_pretty_env_info()]
        except Exception as e:  # collect_env shells out (pip, lscpu): a missing tool is no reason to fail
            lines.append(f"(python -m torch.utils.collect_env failed here: {type(e).__name__}: {e})")
    return "\n".join(lines)


def run_minimal(rc: RootCause) -> tuple[int, str]:
    """Run a root cause's hand-reduced script here, as its top line says: (exit code, output tail)."""
    text = (_ROOT / rc.minimal).read_text()
    name = Path(rc.minimal).name
    return _run(text, name, _ranks_of(text, name))


def _run(text: str, name: str, ranks: int) -> tuple[int, str]:
    """Run the script under torchrun in an empty folder; (exit code, its output's tail)."""
    with tempfile.TemporaryDirectory(prefix="fuzzshard-upstream-") as d:
        (Path(d) / name).write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FUZZSHARD", "TORCHELASTIC"))}
        try:
            launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks else []
            r = subprocess.run([sys.executable, *launch, name], cwd=d, env=env, capture_output=True, text=True,
                               timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            return 124, f"(still running after {RUN_TIMEOUT} s: stopped)"
    # what the script printed; torchrun's own report of a failed rank only when the script printed nothing
    lines = [x for x in (r.stdout or r.stderr).splitlines() if x.strip() and not x.startswith(("W1", "I1", "*****"))]
    return r.returncode, "\n".join(lines[-40:])


def _ranks_of(text: str, name: str) -> int:
    """The ranks a hand-reduced script says it runs on ("torchrun --nproc-per-node N name" near its
    top); 0 for one that says "python name" (a single process, no process group)."""
    m = re.search(r"torchrun --nproc-per-node[ =](\d+) " + re.escape(name), "\n".join(text.splitlines()[:15]))
    return int(m.group(1)) if m else 0


def _torch() -> str:
    import torch

    return torch.__version__
