"""docs/: the generated pages are current, complete, and every relative link leads somewhere."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel

from hyparallel.spec import cluster, schema
from hyparallel.spec.cluster import ClusterSpec, PositiveInt
from hyparallel.tools import docgen

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = "run `python -m hyparallel.tools.docgen`"


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """What the generator writes now (planning the example takes a few seconds: once per module)."""
    return docgen.pages()


def _models(module) -> list[type[BaseModel]]:
    return [
        obj
        for name, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, BaseModel)
        and obj.__module__ == module.__name__
        and not name.startswith("_")
    ]


def _section(text: str, model: type[BaseModel]) -> str:
    """The part of a generated page documenting ``model``: from its anchor to the next one."""
    start = text.index(f'<a id="{model.__name__.lower()}"></a>')
    following = text.find('<a id="', start + 1)
    return text[start : following if following != -1 else len(text)]


# ---- the generated pages -------------------------------------------------------------------------


def test_generated_pages_are_current(rendered):
    outdated = [str(path.relative_to(ROOT)) for path in docgen.stale(DOCS, rendered)]
    assert not outdated, (
        f"{', '.join(outdated)}: not what the schema and presets generate now; {REGENERATE}"
    )


@pytest.mark.parametrize("model", _models(schema), ids=lambda m: m.__name__)
def test_every_plan_field_is_documented(rendered, model):
    section = _section(rendered["plan-reference.md"], model)
    missing = [name for name in model.model_fields if f"| `{name}` |" not in section]
    assert not missing, f"plan-reference.md lacks {model.__name__}.{missing}; {REGENERATE}"


@pytest.mark.parametrize("model", _models(cluster), ids=lambda m: m.__name__)
def test_every_cluster_field_is_documented(rendered, model):
    section = _section(rendered["clusters.md"], model)
    missing = [name for name in model.model_fields if f"| `{name}` |" not in section]
    assert not missing, f"clusters.md lacks {model.__name__}.{missing}; {REGENERATE}"


@pytest.mark.parametrize("name", ClusterSpec.presets())
def test_every_preset_and_figure_is_in_clusters_page(rendered, name):
    text = rendered["clusters.md"]
    assert f"### `{name}`" in text and f"(#preset-{name})" in text
    _, figures = docgen.preset_figures((cluster.preset_dir() / f"{name}.yaml").read_text())
    section = text[text.index(f'<a id="preset-{name}"></a>') :]
    for figure in figures:
        assert f"| `{figure.key}` | `{figure.value}`" in section, figure.key


@pytest.mark.parametrize("name", ClusterSpec.presets())
def test_every_preset_figure_has_a_source(name):
    """Each preset gives the source of each of its figures in a comment."""
    _, figures = docgen.preset_figures((cluster.preset_dir() / f"{name}.yaml").read_text())
    numbers = [
        f
        for f in figures
        if re.fullmatch(r"[-+0-9.e]+", f.value) and f.key not in ("num_nodes", "gpus_per_node")
    ]
    assert numbers
    unsourced = [f.key for f in numbers if not (f.source or f.note)]
    assert not unsourced, f"configs/clusters/{name}.yaml: no source comment for {unsourced}"


def test_preset_figures_match_the_loaded_spec():
    """The line parser reads the same values pydantic loads (no key skipped or misplaced)."""
    for name in ClusterSpec.presets():
        _, figures = docgen.preset_figures((cluster.preset_dir() / f"{name}.yaml").read_text())
        dumped = ClusterSpec.preset(name).model_dump()
        for figure in figures:
            value = dumped
            for part in figure.key.split("."):
                value = value[part]
            assert value == yaml.safe_load(figure.value), (name, figure.key)


def test_example_plan_in_reference_is_a_valid_plan(rendered):
    block = re.search(
        r"## A complete plan.*?```yaml\n(.*?)```", rendered["plan-reference.md"], re.S
    )[1]
    plan = schema.Plan.from_dict(yaml.safe_load(block), source="plan-reference.md example")
    assert plan.parallel.tp == 2 and plan.parallel.pp == 2 and plan.world_size == 8
    assert plan.stages and plan.tensor_parallel and plan.predicted


def test_validation_rules_show_current_errors(rendered):
    text = rendered["plan-reference.md"]
    assert "dp(2) * tp(2) * pp(1) = 4 GPUs, but cluster 'cpu' has" in text
    assert "each module belongs to one stage" in text


# ---- the generator -------------------------------------------------------------------------------


def test_type_text_reads_like_words():
    assert docgen.type_text(PositiveInt) == "integer > 0"
    assert docgen.type_text(PositiveInt | None) == "integer > 0"
    assert docgen.type_text(Literal["a", "b"]) == "one of `a`, `b`"
    assert docgen.type_text(list[schema.StageSpec]) == "list of [StageSpec](#stagespec)"
    assert docgen.type_text(cluster.Fraction) == "number in [0.001, 1]"
    assert docgen.type_text(schema.Degree) == "integer from 1 to 1,048,576"
    assert (
        docgen.type_text(dict[str, schema.TPStyle])
        == "map of string to one of `column`, `row`, `vocab`, `replicate`"
    )


def test_preset_comment_parser():
    text = (
        "# header\nname: x\ndevice:\n  peak:\n    # datasheet\n    a: 1.0e+12  # A\n    b:"
        " 2.0e+12\n  # measured\n  memory_bytes: 8\n"
    )
    header, figures = docgen.preset_figures(text)
    assert header == "header"
    by_key = {f.key: f for f in figures}
    assert by_key["name"].source == ""
    assert (by_key["device.peak.a"].source, by_key["device.peak.a"].note) == ("datasheet", "A")
    assert by_key["device.peak.b"].shared_with == "device.peak.a"
    assert by_key["device.memory_bytes"].source == "measured"


def test_check_names_stale_pages_and_write_fixes_them(tmp_path, monkeypatch, capsys, rendered):
    monkeypatch.setattr(docgen, "pages", lambda: rendered)
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        "plan-reference.md: not current; run `python -m hyparallel.tools.docgen`" in err
        and "clusters.md" in err
    )
    assert docgen.main(["--docs-dir", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    (tmp_path / "clusters.md").write_text("edited by hand\n")
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    assert "clusters.md" in capsys.readouterr().err


# ---- links ---------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    # headings keep their `code`
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    headings = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"', text))


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_existing_files(page):
    broken = []
    for match in _LINK.finditer(_without_code(page.read_text())):
        target = match[1] or match[2]
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(target)
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
