"""The known list's page and numbers (fuzzshard/known/README.md): the headline, the counts, the table by
root cause and by finding, with the regression table over torch releases (releases.py's); and what a run over
releases records into the list (each finding's ``seen_on``, each root cause's ``fixed_in``, the page again),
and what a recorded fix says about a finding made before it (``fixed_in_note``, `fuzzshard show`'s).

`fuzzshard known` prints them, ci/gen_docs.py writes the page and the docs' counts from them, and `fuzzshard
bisect --known --record` and ci/known_table.py record with ``record_known``."""
from __future__ import annotations

import json
from pathlib import Path

from .record import KNOWN_DIR, ROOT_CAUSES, load_known
from .releases import fixed_in, regression_table, release_of, root_cause_states


# ---- the known list's numbers, said in one place: this command's first line, known/README.md, and the docs'
# generated regions (ci/gen_docs.py's known-counts and known-short) all take them from here

def by_project(causes: dict) -> tuple[int, int]:
    """(root causes in torch, in torchao): a root cause of component "torchao" is torchao's bug, to file in
    pytorch/ao (docs/ao/README.md); every other is torch's."""
    ao = sum(1 for rc in causes.values() if rc.component == "torchao")
    return len(causes) - ao, ao


def headline(known: dict, causes: dict) -> str:
    """"N known findings (signatures) and M root causes in torch and K in torchao", the root causes without a
    finding of their own (root_causes.json records a bug fuzzshard met outside a finding: a hand-reduced script
    shows it) named."""
    alone = sorted(rc.id for rc in causes.values() if not rc.signatures)
    torch_n, ao_n = by_project(causes)
    return (f"{len(known)} known findings (signatures) and {torch_n} root causes in torch and {ao_n} in torchao"
            + (f" ({len(alone)} of them with no finding of their own: {', '.join(alone)})" if alone else ""))


def counts_text(known: dict, causes: dict) -> str:
    """The headline, then the root causes by kind and upstream state, and the findings seen only on CUDA."""
    from collections import Counter

    kinds = Counter(rc.kind for rc in causes.values())
    up = Counter((rc.upstream or {}).get("state", "not-reported") for rc in causes.values())
    cuda = sum(1 for f in known.values() if f.devices == ["cuda"])
    words = {"silent": "silent", "raises": "raise", "crash": "crash", "hang": "hang"}
    kind_text = ", ".join(f"{kinds[k]} {w}" for k, w in words.items() if kinds[k])
    return (f"{headline(known, causes)}. The root causes: {kind_text}; upstream {up['open']} open issues, "
            f"{up['closed']} closed, {up['by-design']} by design, {up['not-reported']} not reported. "
            f"{cuda} of the findings seen only on CUDA.")


def short_text(known: dict, causes: dict) -> str:
    silent = sum(1 for rc in causes.values() if rc.kind == "silent")
    torch_n, ao_n = by_project(causes)
    return f"{len(known)} findings and {torch_n} torch root causes and {ao_n} in torchao, {silent} of those silent"


def known_markdown(known: dict) -> str:
    from .record import ORACLES
    from .rootcause import load_root_causes

    causes = load_root_causes(known)
    rows = ["# Known findings in PyTorch", "",
            "Divergences fuzzshard found in torch itself, first by root cause (the torch bug: its id, how it "
            "shows, where it stands upstream, and the findings it is behind), then one row per finding: the "
            "signature, a one-line diagnosis, the shrunk repro (`fuzzshard replay X.json`; `fuzzshard script "
            "X.json -o x.py` writes a standalone script for `torchrun --nproc-per-node W x.py`, torch alone). "
            "Regenerate this page with `python ci/gen_docs.py` (or `fuzzshard known --markdown`; `ci/gen_docs.py "
            "--check` says when it is stale); check the findings with `fuzzshard known --check`.", "",
            counts_text(known, causes), "",
            "## Root causes", "",
            "| root cause | kind | upstream | findings | what |", "|---|---|---|---|---|"]
    for rc in sorted(causes.values(), key=lambda rc: rc.id):
        name = (rc.minimal or "").rsplit("/", 1)[-1]  # known/minimal/'s, else a path from the repository (docs/ao/)
        link = f"minimal/{name}" if (rc.minimal or "").startswith("fuzzshard/known/minimal/") else f"../../{rc.minimal}"
        minimal = f". Hand-reduced: [`{name}`]({link})." if rc.minimal else ""
        rows.append(f"| `{rc.id}` | {rc.kind} | {rc.upstream_text.replace('|', '/')} | {len(rc.signatures)} "
                    f"| {(rc.what or rc.title).replace('|', '/')}{minimal} |")  # (the bug in full: a description)
    rows += regression_table(known, causes)
    rows += ["", "## Findings", "", "| signature | kind | root cause | torch, device | W | diagnosis |",
             "|---|---|---|---|---|---|"]
    for sig, f in sorted(known.items()):
        oracle = ORACLES.get(f.verdict.oracle)
        kind = "?" if oracle is None else oracle.kind.replace("silent", "**silent**")
        where = ", ".join(f.devices) if f.devices else f.environment.get("device") or f.case.device
        rows.append(f"| [`{sig}`]({sig}.json) | {kind} | `{f.root_cause or '?'}` | {f.environment.get('torch', '?')}, "
                    f"{where} | {f.case.world_size} | {f.diagnosis} |")
    return "\n".join(rows)


def fixed_in_note(finding, known: dict | None = None, known_dir: Path = KNOWN_DIR) -> str:
    """"fixed in torch X (root cause R; this finding was made on V)" for a finding made on a torch older than
    the recorded fix of its root cause (its own, or that of the known finding with its signature), else ""."""
    from .rootcause import load_root_causes

    rid = finding.root_cause
    if not rid:
        same = (known if known is not None else load_known(known_dir)).get(finding.signature)
        rid = same.root_cause if same else ""
    rc = load_root_causes(known_dir=known_dir).get(rid) if rid else None
    made = str(finding.environment.get("torch", ""))
    fixed = rc.fixed_after(made) if rc else ""
    return f"{fixed} (root cause {rid}; this finding was made on {release_of(made)})" if fixed else ""


def record_known(results: list[dict], known_dir: Path = KNOWN_DIR) -> list[str]:
    """Each release's outcomes (``{"torch": V, "results": {signature: outcome}}``, as `known --check --json`
    and the per-release run write them) into the known files' ``seen_on`` (skipped: not recorded; a
    signature no longer in the list: ignored), each root cause's ``fixed_in`` derived again, and the
    README regenerated; returns the releases recorded."""
    releases, by_sig = [], {}
    for res in results:
        v = release_of(res["torch"])
        releases.append(v)
        for key, status in res["results"].items():
            sig = Path(key).stem if key.endswith(".json") else key  # a per-release run keys its files by path
            if status != "skipped":
                by_sig.setdefault(sig, {})[v] = status
    for sig, seen in sorted(by_sig.items()):
        path = known_dir / f"{sig}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        data["seen_on"] = dict(sorted({**data.get("seen_on", {}), **seen}.items()))
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    known = load_known(known_dir)
    record_fixed_in(known, known_dir)
    (known_dir / "README.md").write_text(known_markdown(known) + "\n")
    return releases


def record_fixed_in(known: dict, known_dir: Path = KNOWN_DIR) -> dict[str, str]:
    """Set (or clear) each root cause's ``fixed_in`` in root_causes.json from its findings' ``seen_on``; only
    that field changes (the file's key order and layout stay)."""
    path = known_dir / ROOT_CAUSES
    text = path.read_text()
    data = json.loads(text)
    fixes = {}
    for rid, d in data.items():
        fix = fixed_in(root_cause_states([f.seen_on for f in known.values() if f.root_cause == rid]))
        if fix:
            d["fixed_in"], fixes[rid] = fix, fix
        else:
            d.pop("fixed_in", None)
    # the layout it has: sorted keys where the file round-trips with them (then fixed_in sits among them)
    sort = json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n" == text
    new = json.dumps(data, indent=2, sort_keys=sort, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new)
    return fixes
