"""No import cycle among the ``qlabench.*`` modules, counting imports inside functions (a lazy
import hides a cycle from Python, not from this test). The kernel package's independence from
qlabench is tested in test_kernels_package.py."""

import grimp  # a dev dependency: a guard that skips itself would guard nothing
import pytest


@pytest.fixture(scope="module")
def graph():
    """qlabench's import graph, imports inside functions included."""
    return grimp.build_graph("qlabench", include_external_packages=False)


def _cycles(graph) -> list[tuple[str, ...]]:
    """One shortest cycle through each module that lies on one (rotated to start at its least
    name, deduplicated)."""
    found = set()
    for m in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(m):
            chain = graph.find_shortest_chain(importer=imported, imported=m)
            if chain is not None:
                cycle = (m, *chain[:-1])  # chain: imported -> ... -> m
                i = cycle.index(min(cycle))
                found.add(cycle[i:] + cycle[:i])
    return sorted(found)


def test_no_import_cycle_inside_qlabench(graph):
    assert "qlabench.runner" in graph.modules and "qlabench.supervisor" in graph.modules
    cycles = _cycles(graph)
    assert not cycles, "import cycles (module -> ... -> module):\n" + "\n".join(
        " -> ".join((*c, c[0])) for c in cycles)


def test_the_check_sees_imports_inside_functions(graph):
    """``cli`` imports ``runner`` only inside its commands; the graph must still hold the edge."""
    assert graph.direct_import_exists(importer="qlabench.cli", imported="qlabench.runner")


def test_reproduce_only_reads_results(graph):
    """``reproduce`` compares stored rows with a published table: no path from it to the code
    that measures."""
    for m in ("qlabench.runner", "qlabench.measure", "qlabench.correctness", "qlabench.supervisor"):
        chain = graph.find_shortest_chain(importer="qlabench.reproduce", imported=m)
        assert chain is None, " -> ".join(chain)
