"""``fuzzshard upstream FILE.json``: a finding as an issue for pytorch/pytorch.

The shape of PyTorch's bug template: a title "[Component] what goes wrong",
"### 🐛 Describe the bug" with one sentence of what happens, ONE standalone
script, what it prints, expected against actual and the torch source
suspected, then "### Versions". The script is the root cause's hand-reduced
one where it has one, else the straight-line script generated from the case
(scriptgen/), else the flattened kernel, attached by file name (as is a
generated script too long for an issue body, past INLINE_LIMIT); "To
reproduce" says what it runs on (CPU and gloo, N GPUs and NCCL, no process
group: ``runs_on``). With ``run``, that script runs here under torchrun on
the ranks it needs and its own printed lines are the evidence ("Output
(torch X, N ranks):") and the expected/actual; without (or where it needs
GPUs this machine lacks, said), the recorded run's numbers are shown, and
said to be that run's (its world size). The bug is said once (the title), in
torch's words: the fuzzer's own terms, this repository's paths and its
root-cause ids stay out of the body, but for one line at the end that
credits the tool; an issue of another repository than pytorch/pytorch is
written in full (owner/repo#N: a bare #N would link to pytorch/pytorch's).
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import oracle
from ..findings import repro
from ..findings.record import Finding
from ..oracle.source import line_of, torch_frames
from ..findings.rootcause import Matcher, RootCause
from ..scriptgen import straight_script

RUN_TIMEOUT = 300  # seconds for the script's run here
INLINE_LIMIT = 40_000  # GitHub refuses an issue body over 65,536 characters
_ROOT = Path(__file__).resolve().parent.parent.parent  # a root cause's minimal script is named from the repository


@dataclass
class Script:
    """The one script a report shows: ``kind`` is "minimal" (the root cause's hand-reduced one),
    "straight" (scriptgen/'s, inlined) or "flat" (the flattened kernel, attached)."""
    text: str
    name: str
    ranks: int  # torchrun's --nproc-per-node; 0: a plain `python name`
    kind: str

    @property
    def command(self) -> str:
        return f"torchrun --nproc-per-node {self.ranks} {self.name}" if self.ranks else f"python {self.name}"


@dataclass
class Needs:
    """What the script runs on: ``gpus`` (0: the CPU) and the process group's ``backend`` ("" for none)."""
    gpus: int
    backend: str

    @property
    def words(self) -> str:
        """"CPU, gloo", "2 GPUs, NCCL", "one GPU, no process group", ..."""
        where = "CPU" if not self.gpus else "one GPU" if self.gpus == 1 else f"{self.gpus} GPUs"
        group = {"nccl": "NCCL", "gloo": "gloo", "": "no process group", "fake": "the fake process group"}.get(
            self.backend, self.backend)
        return f"{where}, {group}"

    def missing_here(self) -> str:
        """What this machine lacks of it ("2 GPUs"), or ""."""
        if not self.gpus:
            return ""
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = "one GPU" if self.gpus == 1 else f"{self.gpus} GPUs"
        return "" if have >= self.gpus else f"{need}, and this machine has {have or 'none'}"


_CUDA = re.compile(r"""["']cuda\b|\.cuda\(|torch\.device\(\s*["']cuda|device_count\(\)""")
_GROUP = re.compile(r"""init_process_group\(\s*(?:backend\s*=\s*)?(?:["'](\w+)["'])?""")


def runs_on(finding: Finding, script: Script) -> Needs:
    """The device and process group the report's script needs: a hand-reduced script's own (what it calls), a
    generated one's from the case (cuda: one GPU a rank, NCCL)."""
    if script.kind == "minimal":
        code = "\n".join(ln.split("#", 1)[0] for ln in script.text.splitlines())  # its code, not its comments
        group = _GROUP.search(code)
        cuda = bool(_CUDA.search(code))
        backend = (group.group(1) or ("nccl" if cuda else "gloo")) if group else ""
        return Needs(max(script.ranks, 1) if cuda and (backend == "nccl" or not group) else 0, backend)
    cuda = finding.case.device == "cuda"
    backend = str((finding.environment or {}).get("backend") or ("nccl" if cuda else "gloo"))
    return Needs(script.ranks if cuda else 0, backend)


def report(finding: Finding, known: dict, run: bool = True, attachment: Path | None = None) -> tuple[str, dict]:
    """(markdown, {file name: text} to attach): a new issue, or, where its root cause is already filed
    upstream, a comment for that issue (said first, with the link)."""
    causes = Matcher(known).causes
    rc = _root_cause(finding, known)
    # the script's own headline: what it runs (the title has said the bug; once is enough)
    script = choose_script(finding, rc, attachment, headline="A sharded run against the same model without sharding")
    body, attach = _evidence(finding, rc, script, run)
    filed = filed_upstream(rc)
    if filed:
        text = "\n".join(_comment_head(finding, rc, filed) + [_what(finding, rc, script), ""] + body)
        return _no_ids(text, causes), attach
    described = [_plain(rc.what), ""] if rc and _plain(rc.what) else []  # the bug in full, where the title is short of it
    fixed = rc.fixed_after(str((finding.environment or {}).get("torch", ""))) if rc else ""
    if fixed:  # a bug of an older release: the user's answer is an upgrade, the report only where that fails
        described = [f"(Already {fixed}: this was found on torch {finding.environment['torch']}. File it only if "
                     f"it still reproduces on {rc.fixed_in} or later.)", ""] + described
    out = [f"Title: {title(finding, rc)}", "", "### 🐛 Describe the bug", "", *described, _what(finding, rc, script), ""]
    return _no_ids("\n".join(out + body), causes), attach


def _evidence(finding: Finding, rc: RootCause | None, script: Script, run: bool) -> tuple[list[str], dict]:
    """The script, what it prints (or the recorded run's numbers), expected/actual, the source suspected,
    the versions and the credit: the part an issue and a comment share."""
    case, verdict = finding.case, finding.verdict
    out: list[str] = []
    attach: dict[str, str] = {}
    lines = script.text.count("\n")
    needs = runs_on(finding, script)
    if script.kind == "minimal":
        out += [f"To reproduce (torch only; {needs.words}): `{script.command}`", "", "```python", script.text.rstrip(),
                "```", ""]
    elif script.kind == "straight":
        out += [f"To reproduce (torch only; {needs.words}): `{script.command}`. The script trains the model sharded "
                "and a plain copy side by side and compares them after every step.", "",
                f"<details><summary>{script.name} ({lines} lines)</summary>", "", "```python", script.text.rstrip(),
                "```", "</details>", ""]
    else:
        attach[script.name] = script.text
        out += [f"To reproduce, run the attached `{script.name}` ({lines} lines, torch only; {needs.words}; it builds "
                f"the model, trains it sharded and unsharded and compares them after every step): `{script.command}`",
                ""]
    missing = needs.missing_here() if run else ""  # a GPU script on a machine without them: not run, said why
    if run and not missing:
        code, printed = _run(script.text, script.name, script.ranks)
        out += [f"Output (torch {_torch()}, {_ranks_words(script.ranks)}):", "", "```",
                printed.rstrip() or f"(nothing printed; exit code {code})", "```", ""]
        out += _expected_actual_run(finding, _expected(finding, rc, script), code, printed)
    else:
        out += [_recorded(finding, script, f"it needs {missing}" if missing else ""), ""] + \
            oracle.of(verdict).expected_actual(verdict)
    suspect = suspected_source(finding, rc)
    if suspect:
        out += ["**Suspected source**: " + suspect, ""]
    related = _related(rc)
    if related:
        out += [f"Related upstream: {related}", ""]
    out += ["### Versions", "", "```", _versions(finding, run).rstrip(), "```", "", _CREDIT, ""]
    return out, attach


@dataclass
class Filed:
    """The upstream issue (or PR) a root cause is already filed as."""
    ref: str  # "pytorch/pytorch#192202"
    state: str  # "open" or "closed"
    url: str
    fixed_in: str  # the release that fixed it, as `fuzzshard bisect` recorded ("" unknown)


def filed_upstream(rc: RootCause | None) -> Filed | None:
    """Where ``rc`` is already filed upstream (an open or closed issue or PR with a ref), else None."""
    up = (rc.upstream or {}) if rc else {}
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)#(\d+)", up.get("ref") or "")
    if not m or up.get("state") not in ("open", "closed"):
        return None
    # (GitHub sends issues/N on to pull/N for a PR)
    return Filed(m.group(0), up["state"], f"https://github.com/{m.group(1)}/issues/{m.group(2)}", rc.fixed_in)


def _comment_head(finding: Finding, rc: RootCause, filed: Filed) -> list[str]:
    """What a report of an already filed bug says first: where it is filed, and that what follows is a
    comment for that issue, opened by what is new in this finding."""
    env = finding.environment or {}
    if filed.state == "open":
        head = [f"Already filed upstream: {filed.ref} (open) — {filed.url}",
                "Post what follows there as a comment, not as a new issue."]
    else:
        fix = f" (fixed in torch {filed.fixed_in}, as recorded)" if filed.fixed_in else ""
        head = [f"Already filed upstream: {filed.ref} (closed) — {filed.url}",
                f"Closed upstream: check whether your release has the fix{fix}. Where it still reproduces on a "
                f"release that has it, post what follows there as a comment."]
    on = ", ".join(str(x) for x in (env.get("device") or finding.case.device, env.get("backend")) if x)
    seen = finding.signature in rc.signatures  # a known face of it: found again, else a new face
    lead = "This bug again" if seen else "Another form of this bug"
    return head + ["", f"### Comment for {filed.ref}", "",
                   f"{lead}, found on torch {env.get('torch', '?')} ({on}):", ""]


_CREDIT = "Found by fuzzshard, a property-based fuzzer of sharded training."
# what a report must not say to a maintainer: the fuzzer's words and this repository's paths
# (tests/test_upstream.py holds the list it checks)
_REPO_PATH = re.compile(r"\b(minimal|known|fuzzshard)/")
_OWN_NOTE = re.compile(r"corpus|unverified|not confirmed|fuzzshard", re.I)  # the root cause's notes to itself


def choose_script(finding: Finding, rc: RootCause | None, attachment: Path | None = None,
                  headline: str = "") -> Script:
    """The root cause's hand-reduced script where it has one, else the straight-line script
    generated from the case, else the flattened kernel (attached)."""
    case = finding.case
    if rc and rc.minimal and (_ROOT / rc.minimal).exists():
        name = Path(rc.minimal).name
        # an aside about the fuzzer in a comment, "(fuzzshard: ...)", is not the maintainer's business
        text = re.sub(r" ?\([^()\n]*fuzzshard[^()\n]*\)", "", (_ROOT / rc.minimal).read_text())
        return Script(text, name, _ranks_of(text, name), "minimal")
    try:
        text = straight_script(case, headline, finding.environment, finding.verdict)
    except Exception:  # a generator fault must never cost a report its script: the flat one still runs
        text = None
    name = attachment.name if attachment else "repro.py"
    if text is not None:
        kind = "straight" if len(text) <= INLINE_LIMIT else "flat"  # (too long for an issue body: attached)
        return Script(_plain_docstring(text, "repro.py" if kind == "straight" else name),
                      "repro.py" if kind == "straight" else name, case.ranks, kind)
    text = repro.script(case, headline, finding.environment, flat=True)
    return Script(text, name, max(case.ranks, (case.checkpoint.world_size if case.checkpoint else 0) or 0), "flat")


def _plain_docstring(text: str, name: str) -> str:
    """The straight script's docstring in a maintainer's words: its file name, not who wrote it."""
    words = r"\s+".join(re.escape(w) for w in "Written by fuzzshard from a shrunk case: trains".split())
    text = re.sub(words, "Trains", text, count=1)
    return text.replace("THIS_FILE.py", name, 1)


def _ranks_words(ranks: int) -> str:
    return f"{ranks} rank{'s' if ranks != 1 else ''}" if ranks else "one process"


def _recorded(finding: Finding, script: Script, why: str = "") -> str:
    """Where the numbers of a report without a run come from, said plainly (and ``why`` it was not run)."""
    case = finding.case
    mesh = f", mesh {tuple(case.mesh_shape)}" if len(case.mesh_shape) > 1 else ""
    ranks = max(case.ranks, (case.checkpoint.world_size if case.checkpoint else 0) or 0)
    whose = ("not from the script above, which is a smaller hand-reduced reproduction" if script.kind == "minimal"
             else "the run the script above repeats" if script.kind == "straight" else "the run the attached script repeats")
    return (f"The script was not run for this report{f' ({why})' if why else ''}: what follows is from the run in "
            f"which the bug was found "
            f"({_ranks_words(ranks)}{mesh}, torch {(finding.environment or {}).get('torch', '?')}), {whose}.")


_CHECK_LINE = re.compile(r"^(?P<what>.+?): max abs err (?P<err>\S+) \((?P<bad>\d+)/(?P<n>\d+) elements off\); "
                         r"at (?P<at>\(.*?\)): sharded (?P<got>\S+), plain (?P<want>\S+), allowed (?P<allowed>\S+)$")
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def _expected_actual_run(finding: Finding, expected: str, code: int, printed: str) -> list[str]:
    """Expected/actual from what the script printed just now (never the recorded run's numbers)."""
    case = finding.case
    head = f"**Expected**: {expected}; **actual**"
    if code == 0:
        return [f"{head}: the script exits 0 here, so the bug does not reproduce on torch {_torch()}.", ""]
    if code == 124:
        return [f"{head}: the script was still running after {RUN_TIMEOUT} s and was stopped.", ""]
    lines = printed.splitlines()
    checks = [m for m in map(_CHECK_LINE.match, lines) if m]
    if checks:
        rows = [f"{head} (from the output above):", "",
                "| what | element | without sharding (expected) | sharded (actual) | max abs err | rounding allows there | elements off |",
                "|---|---|---|---|---|---|---|"]
        rows += [f"| {m['what']} | {m['at']} | {m['want']} | {m['got']} | {m['err']} | {m['allowed']} | "
                 f"{m['bad']}/{m['n']} |" for m in checks[:6]]
        first = checks[0]
        rows += ["", f"`{first['what']}` differs by more than {case.dtype} rounding allows: {first['err']} vs at most "
                     f"{first['allowed']}."]
        other = [ln for ln in lines if ln.startswith(("step ", "after the constructor")) and not _CHECK_LINE.match(ln)]
        return rows + ([""] + [f"- {ln}" for ln in other[:6]] if other else []) + [""]
    raised = [m.group(1) for m in map(_EXCEPTION.match, lines) if m]
    if raised:
        return [f"{head}: `{raised[-1]}` (the output above), exit code {code}.", ""]
    said = [ln for ln in lines if re.search(r"\bBUG\b", ln)]
    return [f"{head}: what the script prints above" + (f" (`{said[-1].strip()}`)" if said else "") +
            f", exit code {code}.", ""]


def _related(rc: RootCause | None) -> str:
    """The root cause's upstream note, without what only this repository knows (its scripts' paths)."""
    note = (rc.upstream or {}).get("note", "") if rc else ""
    kept = "; ".join(p for p in note.split("; ") if p and not _REPO_PATH.search(p) and not _OWN_NOTE.search(p))
    return full_refs(re.sub(r"\bface(s?)\b", r"form\1", kept))  # (a "face" of a bug: the fuzzer's word)


# "owner/repo#N" followed by more numbers of the same list ("and #M", ", #M", "/#M", "or #M")
_LISTED = re.compile(r"(?<![\w/])([\w.-]+/[\w.-]+)#(\d+)((?:\s*(?:,|/|and|or)\s*#\d+)+)")


def full_refs(text: str) -> str:
    """Every issue or PR of another repository than pytorch/pytorch written in full: in a pytorch/pytorch issue a
    bare "#N" links to pytorch/pytorch#N, so "meta-pytorch/torchrec#3809 and #3891" must say
    "meta-pytorch/torchrec#3809 and meta-pytorch/torchrec#3891"."""
    def each(m):
        repo = m.group(1)
        return f"{repo}#{m.group(2)}" + re.sub(r"(?<![\w/])#(\d+)", lambda n: f"{repo}#{n.group(1)}", m.group(3))

    return _LISTED.sub(lambda m: m.group(0) if m.group(1) == "pytorch/pytorch" else each(m), text)


def _no_ids(text: str, causes: dict) -> str:
    """The report without this repository's root-cause ids (a note that names another root cause by its id): each
    said as the bug it is, in its title's words. Code blocks (the script, its output) are left as they are."""
    ids = sorted((rid for rid in causes if rid), key=len, reverse=True)
    if not ids:
        return text
    named = re.compile(r"`?\b(" + "|".join(map(re.escape, ids)) + r")\b`?")
    parts = text.split("```")
    for i in range(0, len(parts), 2):  # outside the fences
        parts[i] = named.sub(lambda m: f'the bug "{causes[m.group(1)].title}"', parts[i])
    return "```".join(parts)


TITLE_LIMIT = 120  # a root cause's title is at most this (tests/test_known_files.py); a new finding's is cut to it


def title(finding: Finding, rc: RootCause | None) -> str:
    case, v = finding.case, finding.verdict
    if rc:
        component = _component(rc, case.target)
        words = rc.title.split(" ", 1)  # "[FSDP1] FSDP1 FULL_STATE_DICT ...": the component once,
        # unless it is the sentence's subject ("[DTensor] DTensor has no ...": a verb follows)
        once = words[0] == component and len(words) > 1 and not re.match(r"[a-z]+s\b(?![_.(])", words[1])
        return f"[{component}] {words[1] if once else rc.title}"
    # a new finding: what went wrong, as its oracle says it (an error's whole message is in the body)
    head = f"[{_component(None, case.target)}] "
    said = oracle.of(v).title(case, v)
    return head + (said if len(said) <= TITLE_LIMIT else said[:TITLE_LIMIT - 1].rsplit(" ", 1)[0] + "…")


def _plain(what: str) -> str:
    """A root cause's full statement for a maintainer, as a sentence; "" where it has none or speaks of
    this repository."""
    if not what or _REPO_PATH.search(what) or _OWN_NOTE.search(what):
        return ""
    return what if what.endswith(".") else what + "."


# ---- the torch source suspected, at the finding's own torch: its release tag (or git commit) and the
# line its own traceback gives, never the line of the torch installed here where that is another one

_GITHUB = "https://github.com/pytorch/pytorch/blob"
_CITED = re.compile(r"`torch/(?P<path>[\w/.]+\.py):(?P<line>\d+)` \((?P<fn>[\w.]+)\)(?: — \S+?(?=,|\s|$))?")


def source_ref(env: dict) -> tuple[str, str]:
    """(the pytorch/pytorch git ref a torch was built from, a note where it is only the nearest tag) for a
    finding's ``environment``: "2.11.0+cu130" -> "v2.11.0"; "2.10.0rc3" -> "v2.10.0-rc3"; a development build
    -> its git commit ("+git<sha>" in its version, or a recorded "torch_git"), else its release's tag, said."""
    version = str(env.get("torch") or "")
    base = version.split("+", 1)[0]
    if re.fullmatch(r"\d+\.\d+\.\d+", base):
        return f"v{base}", ""
    rc_build = re.fullmatch(r"(\d+\.\d+\.\d+)rc(\d+)", base)
    if rc_build:
        return f"v{rc_build.group(1)}-rc{rc_build.group(2)}", ""
    sha = re.search(r"\+git([0-9a-f]{7,40})\b", version)
    sha = sha.group(1) if sha else str(env.get("torch_git") or "")
    if re.fullmatch(r"[0-9a-f]{7,40}", sha):
        return sha, ""
    nearest = re.match(r"\d+\.\d+\.\d+", base)
    if nearest:
        return (f"v{nearest.group(0)}", f"the nearest release tag: torch {version} is a development build that "
                "records no git commit, so its lines may differ")
    return "", ""


def suspected_source(finding: Finding, rc: RootCause | None) -> str:
    """"`torch/x.py:N` (function) — link" at the finding's torch: the root cause's API where one is recorded,
    else the innermost telling torch frame of an error or a crash, else the optimizer implementation a step
    divergence runs (a guess, and said to be one), as its oracle says."""
    v, case = finding.verdict, finding.case
    if rc and rc.api:
        m = re.match(r"torch/([\w/]+\.py)(?::([\w.]+))?", rc.api)
        if not m:
            return f"`{rc.api}`"
        rest = rc.api[m.end():].strip()
        more = rest if rest.startswith("(") else f"(recorded: `{rc.api}`)"  # what the api names beyond one function
        return _at_finding(finding, m.group(1), m.group(2), None) + (f" {more}" if rest else "")
    said = oracle.of(v).source(case, v)  # (its link is at the installed torch: made again at the finding's)
    m = _CITED.search(said)
    if not m:
        return said
    return said[:m.start()] + _at_finding(finding, m.group("path"), m.group("fn"), int(m.group("line"))) + said[m.end():]


def _at_finding(finding: Finding, path: str, fn: str | None, line: int | None) -> str:
    """torch/``path``'s function ``fn`` (None: any, the innermost of the traceback's there) linked at the
    finding's torch. The line: a frame of it in the finding's own traceback (``line`` where it is one of them);
    else the installed torch's, only where that is the finding's torch; else none (the file is linked)."""
    env = finding.environment or {}
    err = finding.verdict.error_record if finding.verdict else None
    frames = torch_frames(((err.traceback or "") + "\n" + err.extra.get("log", "")) if err else "")
    own = [(ln, f) for p, ln, f in frames if p == path and (fn is None or f == fn.rsplit(".", 1)[-1])]
    ref, note = source_ref(env)
    if line not in [ln for ln, _ in own]:
        if own:
            line, fn = own[0][0], fn or own[0][1]
        elif fn and _is_installed(ref, note):
            line = line or line_of(f"torch/{path}", fn)
        else:
            line = None
    where = f"`torch/{path}:{line}`" if line else f"`torch/{path}`"
    cited = f"{where} ({fn})" if fn else where
    if not ref:
        return cited
    link = f"{_GITHUB}/{ref}/torch/{path}" + (f"#L{line}" if line else "")
    return f"{cited} — {link}" + (f" ({note})" if note else "")


def _is_installed(ref: str, note: str) -> bool:
    """Whether the torch installed here was built from ``ref`` (a tag that is only the nearest one is not)."""
    import torch

    here = source_ref({"torch": torch.__version__, "torch_git": torch.version.git_version})
    return bool(ref) and not note and here == (ref, "")


def _root_cause(finding: Finding, known: dict) -> RootCause | None:
    matcher = Matcher(known)  # (it holds the root causes too)
    rid = finding.root_cause or (known[finding.signature].root_cause if finding.signature in known else "")
    if not rid and finding.verdict:  # a new finding: only a unique match on what identifies the bug
        ids = matcher.suspects(finding.case, finding.verdict)
        rid = ids[0] if len(ids) == 1 else ""
    return matcher.causes.get(rid)


def _component(rc: RootCause | None, target: str) -> str:
    """What the title's [brackets] name: the root cause's component, else the target's (its spec says)."""
    from .. import targets

    if rc and rc.component:
        return rc.component
    return (targets.get(target).spec.component if target in targets.names() else "") or target


# what a root cause's hand-reduced script shows where it shows another kind of failure than the finding
# (a bug that makes one case fail silently can make another raise): said by the root cause's kind
_KIND_WORDS = {
    "silent": ("No error is raised, but the result is silently wrong: it differs from the same computation "
               "without sharding.", "the result matches the same computation without sharding, up to rounding"),
    "raises": ("It raises an error where the same model trains without sharding.",
               "it trains, as the same model does without sharding"),
    "crash": ("A rank is killed by a signal where the same model trains without sharding.", "every rank finishes"),
    "hang": ("The ranks hang where the same model trains without sharding.", "every rank finishes"),
}


def _other_kind(finding: Finding, rc: RootCause | None, script: Script) -> str:
    """The root cause's kind where its hand-reduced script shows another kind of failure than the finding, else ""."""
    kind = rc.kind if rc and script.kind == "minimal" else ""
    return kind if kind in _KIND_WORDS and not oracle.of(finding.verdict).kind.startswith(kind) else ""


def _what(finding: Finding, rc: RootCause | None, script: Script) -> str:
    """One sentence of what happens, in torch's words (the title has said what the bug is)."""
    o, v = oracle.of(finding.verdict), finding.verdict
    other = _other_kind(finding, rc, script)
    if other:
        return _KIND_WORDS[other][0]
    return o.what(finding.case, v) if o.what else o.title(finding.case, v)


def _expected(finding: Finding, rc: RootCause | None, script: Script) -> str:
    o, v = oracle.of(finding.verdict), finding.verdict
    other = _other_kind(finding, rc, script)
    if other:
        return _KIND_WORDS[other][1]
    return o.expected(finding.case, v) if o.expected else "the sharded run behaves like the same model without sharding"


def _versions(finding: Finding, collect: bool) -> str:
    env = finding.environment or {}
    lines = [f"found on: torch {env.get('torch', '?')}, {env.get('device', finding.case.device)}, backend "
             f"{env.get('backend', '?')}, python {env.get('python', '?')}, {env.get('platform', '?')}"]
    import torch

    lines.append(f"this report: torch {torch.__version__} (git {torch.version.git_version[:12]}), python "
                 f"{platform.python_version()}, {platform.platform()}")
    from ..findings.releases import release_key

    tried = sorted((finding.seen_on or {}).items(), key=lambda kv: release_key(kv[0]))  # fuzzshard bisect's record
    lines.append("releases tried: " + (", ".join(f"{v} {got}" for v, got in tried) if tried else
                                       "only the one it was found on"))
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
    return r.returncode, _shown(r.stdout or "", r.stderr or "", d)


def _shown(stdout: str, stderr: str, folder: str) -> str:
    """What a report quotes of a run: the script's printed lines, then the lowest failing rank's
    traceback (carets dropped, torch's paths from torch/ on, the other ranks' last line where it
    differs); torchrun's own report of a failed child only when there is nothing else."""
    def clean(ln: str) -> str:
        ln = re.sub(r'"[^"]*/site-packages/(torch/[^"]*)"', r'"\1"', ln)
        return ln.replace(folder + "/", "").replace(folder, ".")

    def noise(ln: str) -> bool:  # launcher logs, warnings, caret lines
        return not ln.strip() or ln.startswith(("W1", "I1", "E1", "*****")) or bool(
            re.match(r"^(\[rank\d+\]:)?\s*[\^~]+\s*$|^\[rank\d+\]:\[?[WI]\d{4} ", ln))

    out = [clean(x) for x in stdout.splitlines() if not noise(x)]
    by_rank: dict[int, list[str]] = {}
    for ln in stderr.splitlines():
        m = re.match(r"\[rank(\d+)\]: ?", ln)
        if m and not noise(ln):
            by_rank.setdefault(int(m.group(1)), []).append(clean(ln))
    if by_rank:
        low = min(by_rank)
        tb = by_rank[low]
        out += tb if len(tb) <= 25 else [tb[0], f"[rank{low}]:   ...", *tb[-23:]]
        out += [lines[-1] for r, lines in sorted(by_rank.items())
                if r != low and lines[-1].split(": ", 1)[-1] != by_rank[low][-1].split(": ", 1)[-1]]
    else:
        # a traceback of the script itself (before its process group): up to the launcher's own traceback
        err = stderr.splitlines()
        launcher = next((i for i, ln in enumerate(err) if ln.startswith("Traceback") and i + 1 < len(err) and
                         re.search(r"<frozen runpy>|torch/distributed/run\.py|bin/torchrun", err[i + 1])), len(err))
        start = max((i for i, ln in enumerate(err[:launcher]) if ln.startswith("Traceback")), default=None)
        if start is not None:
            own = [ln for ln in err[start:launcher] if not noise(ln)]
            end = max((i for i, ln in enumerate(own) if _EXCEPTION.match(ln)), default=len(own) - 1)
            out += [clean(ln) for ln in own[:end + 1]][-25:]
        elif not out:
            out = [clean(x) for x in err if not noise(x)]
    return "\n".join(out[-60:])


def _ranks_of(text: str, name: str) -> int:
    """The ranks a hand-reduced script says it runs on ("torchrun --nproc-per-node N name" near its
    top); 0 for one that says "python name" (a single process, no process group)."""
    m = re.search(r"torchrun --nproc-per-node[ =](\d+) " + re.escape(name), "\n".join(text.splitlines()[:15]))
    return int(m.group(1)) if m else 0


def _torch() -> str:
    import torch

    return torch.__version__
