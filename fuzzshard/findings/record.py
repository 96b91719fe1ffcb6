"""Findings: their stable signatures, their files, and the known-findings list.

A signature names a bug, not a case: target + oracle + the failing quantity
(or the exception type and normalised message), so the same bug found twice,
in any model, is one file; what each oracle's signature and summary say is
in its module in fuzzshard/oracle/. Files are written atomically (temp + rename).
"""
from __future__ import annotations

import enum
import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import oracle
from ..case import Case, CaseError
# each oracle's knowledge lives in oracle/; these names stay importable from here (cli, tests)
from ..oracle import ORACLES, Oracle  # noqa: F401
from ..oracle.error_parity import message_digest, missing_strategy_op  # noqa: F401
from ..verdict import Verdict

KNOWN_DIR = Path(__file__).resolve().parent.parent / "known"
ROOT_CAUSES = "root_causes.json"  # known/: root cause id -> title, kind, upstream state (not a finding)


def signature(case: Case, verdict: Verdict) -> str:
    """The finding's name: target, oracle and what identifies the bug (each oracle's module in oracle/ says)."""
    sig = oracle.of(verdict).signature(case, verdict)
    # a compiled run's bug is compile's until an eager run shows it too: its own name, never an eager one's
    tag = compiled_tag(case)
    return sig.replace(f"{case.target}.", f"{case.target}.{tag}.", 1) if tag else sig


def compiled_tag(case: Case) -> str:
    """What ran under torch.compile, as its target's spec names it ("" for nothing)."""
    from .. import targets

    tag = targets.get(case.target).spec.compiled if case.target in targets.names() else None
    return tag(case) if tag else ""


def summary(verdict: Verdict) -> str:
    """One line: what diverged, where, by how much, against which tolerance."""
    return oracle.of(verdict).summary(verdict)


def environment(pool_info: dict | None, backend: str, device: str | None = None) -> dict:
    import hypothesis
    import torch

    from .. import __version__

    info = pool_info or {}
    # the commit its torch was built from (a development build has no release tag to link its source at)
    git = torch.version.git_version if info.get("torch") == torch.__version__ else None
    return {
        "fuzzshard": __version__,  # which fuzzshard's oracles and tolerances judged it
        "torch": info.get("torch"),
        **({"torch_git": git} if git and git != "Unknown" else {}),
        "device": info.get("device_name") or device,
        **{k: info[k] for k in ("cuda", "nccl") if info.get(k)},
        "hypothesis": hypothesis.__version__,
        **_torchao(info.get("device_name") or device),
        "python": platform.python_version(),
        "backend": backend,
        "platform": platform.platform(),
    }


def _torchao(device) -> dict:
    """torchao's version where it is installed (--ao's float8, kernel/float8.py): on CPU its float8 matmuls are
    emulated (emulate=True), which the finding says."""
    from importlib import metadata

    try:
        version = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return {}
    return {"torchao": version + (" (float8 emulated on CPU)" if str(device or "cpu").startswith("cpu") else "")}


class Stage(str, enum.Enum):
    """Where a finding stands (a str: written to and read from JSON as its value)."""
    CONFIRMED = "confirmed"  # this case gave this signature in fresh workers
    SHRINKING = "shrinking"  # a smaller case found in the warm workers, its fresh run still to come
    UNCONFIRMED = "unconfirmed"  # no time was left to confirm it
    PROVISIONAL = "provisional"  # a hang seen under a derived limit, on disk before its run at --case-timeout
    KNOWN_BY_ADDRESS = "known by address"  # a new signature the session counts as a known root cause's
    SIMULATED_ONLY = "simulated only"  # too large to confirm on real processes here (session/simulate.py)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def read(cls, text: str):
        """The stage a file says; a word this fuzzshard does not know stays the word."""
        try:
            return cls(text)
        except ValueError:
            return text


@dataclass
class Finding:
    signature: str
    case: Case
    verdict: Verdict | None  # None: a bare case file, no finding
    deterministic: bool = True
    count: int = 1
    environment: dict = field(default_factory=dict)
    diagnosis: str = ""
    stage: Stage = Stage.CONFIRMED
    # known hangs only: case fields that always hit it ({"checkpoint.kind": "broadcast", "world_size": [2, 3]});
    # a matching case is counted as a hit of this finding without being run (it would cost the case timeout)
    trigger: dict = field(default_factory=dict)
    # known findings with a signature any other bug could have (pp.parity.loss): known only for cases that
    # match this (field paths and facts.NAME, as a trigger), so a new bug of that signature elsewhere is new
    only_when: dict = field(default_factory=dict)
    # known findings only: the devices it shows on ([] any); a torch bug seen only on CUDA does not
    # hide a new bug of the same signature on the CPU
    devices: list = field(default_factory=list)
    root_cause: str = ""  # known findings: the id of their root cause in known/root_causes.json
    # one finding per bug (generalize.py): the other signatures the same bug showed under, and the
    # table of the case's variants (dimension, value, outcome, signature) it fails and passes with
    faces: list = field(default_factory=list)
    generalization: list = field(default_factory=list)
    removed: list = field(default_factory=list)  # what the reducer took out of the shrunk case (reduce.py)
    # how far the reducer got (reduce.Reduction.record): {"minimal": true, "seconds", "runs"}, or not 1-minimal
    # with the edits left untried when its budget ran out ("untried", "budget"), or why it did not run ("why")
    reduction: dict = field(default_factory=dict)
    # known findings only: what `known --check` gave on each torch release it ran on ({"2.10.0": "reproduces",
    # "2.14.1": "fixed", ...}; ci/known_table.py writes it, known/README.md's regression table reads it)
    seen_on: dict = field(default_factory=dict)

    @property
    def summary(self) -> str:
        """What the verdict says, in one line: always derived, never the copy a file stores (a tool that
        rewrites a file's case and verdict may leave that copy saying another run's numbers)."""
        return summary(self.verdict) if self.verdict is not None else ""

    def to_dict(self) -> dict:
        return {
            "signature": self.signature,
            "summary": self.summary,  # (for a person reading the file; read back, it is derived again)
            "deterministic": self.deterministic,
            "stage": self.stage,
            "diagnosis": self.diagnosis,
            "verdict": _jsonable(self.verdict.to_dict()),
            "environment": self.environment,
            "case": self.case.to_dict(),
            **({"trigger": self.trigger} if self.trigger else {}),
            **({"only_when": self.only_when} if self.only_when else {}),
            **({"devices": self.devices} if self.devices else {}),
            **({"root_cause": self.root_cause} if self.root_cause else {}),
            **({"faces": sorted(self.faces)} if self.faces else {}),
            **({"generalization": self.generalization} if self.generalization else {}),
            **({"removed": self.removed} if self.removed else {}),
            **({"reduction": self.reduction} if self.reduction else {}),
            **({"seen_on": self.seen_on} if self.seen_on else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Finding:
        if not isinstance(data, dict) or "case" not in data:
            raise CaseError("not a fuzzshard finding: no 'case' field")
        try:
            verdict = Verdict.from_dict(data["verdict"]) if data.get("verdict") else None
        except (ValueError, TypeError) as e:  # a status it cannot have, a mismatch without its fields
            raise CaseError(f"not a fuzzshard finding: its verdict: {e}") from None
        return cls(
            signature=data.get("signature", ""),
            case=Case.from_dict(data["case"]),
            verdict=verdict,
            deterministic=data.get("deterministic", True),
            stage=Stage.read(data.get("stage", "confirmed")),
            environment=data.get("environment", {}),
            diagnosis=data.get("diagnosis", ""),
            trigger=data.get("trigger", {}),
            only_when=data.get("only_when", {}),
            devices=data.get("devices", []),
            root_cause=data.get("root_cause", ""),
            faces=data.get("faces", []),
            generalization=data.get("generalization", []),
            removed=data.get("removed", []),
            reduction=data.get("reduction", {}),
            seen_on=data.get("seen_on", {}),
        )


def load_finding(path: str | os.PathLike) -> Finding:
    """A repro file: a finding JSON, or a bare case JSON. CaseError if unreadable."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CaseError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CaseError(f"{path} is not valid JSON ({e})") from None
    if isinstance(data, dict) and "case" not in data and "target" in data:
        return Finding(signature="", case=Case.from_dict(data), verdict=None)
    return Finding.from_dict(data)


def read_record(out_dir: str | os.PathLike, sig: str) -> dict:
    """OUT/<sig>.json's whole record, as written: the Finding's fields and those only a file holds (what a
    simulated session and its real-process check said of it, ``simulation``)."""
    return json.loads((Path(out_dir) / f"{sig}.json").read_text())


def write_finding(out_dir: str | os.PathLike, finding: Finding, script: str | None,
                  replace: bool = False, name: str | None = None) -> tuple[Path, Path]:
    """OUT/<signature>.json and, given a script, .py (the .py first: a .json in
    place means both are whole; ``name``: another file name than the signature, a
    known finding's ``<signature>.<suffix>``). An existing file of the same name is
    kept unless the new case is smaller (a simpler repro) or ``replace``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = name or finding.signature
    jpath, ppath = out / f"{name}.json", out / f"{name}.py"
    if jpath.exists() and not replace:
        try:
            old = load_finding(jpath)
            if len(old.case.to_json()) <= len(finding.case.to_json()):
                return jpath, ppath
        except CaseError:
            pass  # a broken old file is replaced
    if script is not None:
        atomic_write(ppath, script)
    atomic_write(jpath, json.dumps(finding.to_dict(), indent=2, sort_keys=True) + "\n")
    return jpath, ppath


def publish_finding(directory: Path, finding: Finding, script: str) -> bool:
    """Write ``finding`` as DIR/<sig>.json + .py unless another writer (a soak's
    other cell) did first. Each file is made whole under a temporary name and
    linked into place (os.link fails if the name exists): never half-written,
    never twice. Returns whether this call published it."""
    sig = finding.signature
    # the .py first: a .json in place means both are whole
    atomic_write(directory / f"{sig}.py", script, exclusive=True)
    return atomic_write(directory / f"{sig}.json", json.dumps(finding.to_dict(), indent=2, sort_keys=True) + "\n",
                        exclusive=True)


def atomic_write(path: Path, text: str, exclusive: bool = False) -> bool:
    """Write ``path`` whole under a temporary name, then put it in place: a
    reader never sees half a file. ``exclusive``: only if ``path`` does not
    exist yet (os.link refuses an existing name; concurrent writers, one
    winner); returns whether this call wrote it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp makes it private
    if not exclusive:
        os.replace(tmp, path)
        return True
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)


def is_known(sig: str, case: Case, known: dict[str, Finding]) -> bool:
    """Whether ``sig`` on this case's device is a known finding."""
    return known_signature(sig, case, known) is not None


def known_signature(sig: str, case: Case, known: dict[str, Finding]) -> str | None:
    """The known finding ``sig`` is on this case's device, by its name in ``known``: itself, or the
    same bug under a built-in target the case's target is made of (a plugin's
    parallelism on FSDP2 meets FSDP2's and DTensor's known bugs); of several under one signature
    (``under``), the first whose ``only_when`` holds for the case."""
    from .. import targets

    target = targets.get(case.target) if case.target in targets.names() else None
    family = getattr(target, "known_as", ())
    errors_as = getattr(target, "known_errors_as", ())  # their known errors only (a raise of the same message)
    sigs = [sig]
    tag = compiled_tag(case)
    head = f"{case.target}.{tag}."
    if tag and sig.startswith(head) and sig[len(head):].split(".")[0] in ("error", "crash", "hang"):
        # a compiled run that raises as a known eager bug does is that bug (unless recorded as compile's own)
        sigs.append(sig.replace(f".{tag}.", ".", 1))
    if case.checkpoint and case.checkpoint.async_save and ".checkpoint.dcp_async." in sig:
        # an async save whose load loses what a blocking save's load loses is that known bug (the state-dict
        # API's), unless recorded as the async path's own
        sigs.append(sig.replace(".checkpoint.dcp_async.", ".checkpoint.dcp.", 1))
    for s in [x for one in sigs for x in [one] + _as_family(one, case.target, family)
              + (_as_family(one, case.target, errors_as) if one.startswith(f"{case.target}.error.") else [])]:
        for name in under(s, known):
            f = known[name]
            if (not f.devices or case.device in f.devices) and _holds(case, f.only_when):
                return name
    return None


def under(sig: str, known: dict[str, Finding]) -> list[str]:
    """The names of the known findings of signature ``sig``, in the order they are tried: ``sig`` itself,
    then ``sig.SUFFIX`` (another root cause under one signature, told apart by its ``only_when``)."""
    return ([sig] if sig in known else []) + sorted(
        k for k, f in known.items() if k.startswith(sig + ".") and f.signature == sig)


def _holds(case: Case, conditions: dict) -> bool:
    """Whether the case matches ``conditions`` (a known finding's ``only_when``; none: any case)."""
    if not conditions:
        return True
    data = {**case.to_dict(), "facts": facts(case)}
    return all(_matches(_field(data, k), v) for k, v in conditions.items())


def _as_family(sig: str, target: str, family) -> list[str]:
    rest = sig[len(target):] if sig.startswith(target + ".") else None
    return [t + rest for t in family] if rest else []


def triggered(case: Case, known: dict[str, Finding]) -> str | None:
    """The name of a known finding whose recorded trigger this case matches."""
    for name, f in known.items():
        if f.trigger and known_signature(f.signature or name, case, known) == name and _holds(case, f.trigger):
            return name
    return None


def facts(case: Case) -> dict:
    """What a case is beyond its fields, for triggers to name as ``facts.NAME``:
    whether it draws dropout masks, and its target's derived facts (the target's spec says which)."""
    from .. import targets

    from ..kernel.dropout import has_dropout

    derive = targets.get(case.target).spec.facts if case.target in targets.names() else None
    # every target's: whether the model draws dropout masks (a dropout layer of p > 0, a decoder's dropout)
    return {"dropout": has_dropout(case.model), **(derive(case) if derive else {})}


def _field(data: dict, path: str):
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _matches(value, want) -> bool:
    """A list: any of these; "*": any value at all; else this value."""
    if want == "*":
        return value is not None
    return value in want if isinstance(want, list) else value == want


def load_known(directory: str | os.PathLike = KNOWN_DIR) -> dict[str, Finding]:
    """The known-findings list: name -> finding (with its diagnosis). A finding's name is its file's,
    ``<signature>``, or ``<signature>.<suffix>`` for another root cause under a signature a known finding
    has already (each told apart by its ``only_when``; ``known_signature`` tries them in order)."""
    known = {}
    for p in sorted(Path(directory).glob("*.json")):
        if p.name == ROOT_CAUSES:
            continue
        f = load_finding(p)
        known[p.stem if p.stem.startswith(f.signature + ".") else f.signature] = f
    return known


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return repr(v)
    return v
