"""docs/architecture.md's import diagram is the one scripts/import_graph.py reads from the
code: regenerated here and compared, so it cannot drift."""

import textwrap

import pytest


@pytest.fixture(scope="module")
def graph_script(load_script):
    return load_script("import_graph")


def test_the_doc_shows_the_imports_as_they_are(graph_script):
    doc = graph_script.DOC.read_text()
    graph = graph_script.import_graph()
    fresh = graph_script.embed(doc, graph_script.render(graph))
    assert doc == fresh, "docs/architecture.md: run python scripts/import_graph.py --write"
    assert graph["attention"]["cache"] == graph["engine"]["attention"] == "module level"
    assert "server" not in graph["engine"] and "torch" not in graph["cache"]


def test_kinds_of_import_on_a_made_up_package(graph_script, tmp_path):
    files = {
        "a/__init__.py": "from .x import f\n",
        "a/x.py": """
            from typing import TYPE_CHECKING
            from radixserve.b import g
            from ..c.y import h
            if TYPE_CHECKING:
                from radixserve.d import T
            def later():
                import radixserve.e.z
                from radixserve import b
        """,
        "b/__init__.py": "from radixserve.util import k\n",
        "c/y.py": "", "d/__init__.py": "", "e/z.py": "", "util.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    graph = graph_script.import_graph(tmp_path)
    assert graph["a"] == {"b": "module level", "c": "module level", "e": "lazy"}
    assert graph["b"] == {"util": "module level"}
    lines = graph_script.render(graph).splitlines()
    assert lines[1].split() == ["a", "b,", "c", "[e]"]          # the most dependent first
    assert [line.split()[0] for line in lines[2:4]] == ["b", "c"]
    (tmp_path / "util.py").write_text("from radixserve.a import f\n")
    with pytest.raises(ValueError, match="cycle"):
        graph_script.render(graph_script.import_graph(tmp_path))
