"""The docs' generated regions (counts of known findings, targets, oracles,
planted bugs, tests; the command tables; the code map; the architecture's floors) are what the code gives
now, and the README keeps its promises: the test command CI runs, and a link
for every docs page. Pure: reads files and builds the parser, no torch."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "ci" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_region_is_current():
    stale = _gen_docs().stale()
    assert not stale, f"stale generated regions {stale}: run python ci/gen_docs.py"


def test_a_region_with_a_stale_number_is_caught_and_rewritten():
    gen = _gen_docs()
    text = "known: <!-- generated: target-count -->999<!-- /generated -->\n"
    new = gen.render(text, {})
    assert "999" not in new and re.search(r"target-count -->\d+<!--", new)
    assert gen.render(new, {}) == new  # rendering is a fixed point


def test_the_readme_test_command_is_the_one_ci_runs_and_links_resolve():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' && .venv/bin/python -m pytest"
    assert f"\n{command}\n" in readme
    assert ci.rstrip().endswith(command)
    # every relative link from the README and docs/ to a page that exists in this tree (other pages' authors
    # add docs/search.md, versions.md and simulate.md: those may be missing until they land)
    pending = {"docs/search.md", "docs/versions.md", "docs/simulate.md"}
    for page in [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in link:
                continue
            target = (page.parent / link).resolve()
            rel = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else str(target)
            assert target.exists() or rel in pending, f"{page.relative_to(ROOT)} links to missing {link}"


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README's map does not link: {unlinked}"


def test_the_known_lists_readme_is_generated_whole_and_a_stale_one_is_caught():
    gen = _gen_docs()
    readme = ROOT / "fuzzshard" / "known" / "README.md"
    assert readme in gen.WHOLE and readme.read_text() == gen.WHOLE[readme]()
    page = gen.WHOLE[readme]()
    # the numbers the docs' regions say are the page's, said in one place (fuzzshard/cli/known.py)
    assert gen.known_counts() in page and gen.known_counts().startswith(gen.known_short().split(",")[0].replace(
        " findings and", " known findings (signatures) and").replace(" torch root causes", " root causes in torch"))
    stale_page = ROOT / "tests" / "no-such-file.md"  # a generated file that is missing or differs is stale
    gen.WHOLE[stale_page] = lambda: "new\n"
    assert "tests/no-such-file.md (generated whole)" in gen.stale()


def test_the_architecture_page_shows_every_floor_and_room():
    """docs/architecture.md holds the floors' generated regions, and its table names every room of
    tests/test_imports.py's FLOORS, each on its floor."""
    gen = _gen_docs()
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "<!-- generated: architecture-floors -->" in page and "<!-- generated: architecture-exceptions -->" in page
    fl = gen._floors()
    table = gen.architecture_floors()
    for rooms in (rooms for _, rooms in fl.FLOORS):
        for r in rooms:
            assert f"| `{gen._room_path(r)}` |" in table, r
    assert table in page  # (current: test_every_generated_region_is_current)
