"""The package layering the architecture promises, checked on the source: ``megatron.core.dmi``
never imports ``megatron.training`` (any loop built on megatron-core can use it), and the reader
never imports the training-side sinks that write spool files."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
CORE = ROOT / "megatron" / "core" / "dmi"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_megatron_training():
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("megatron.training"))
        for p in CORE.rglob("*.py")
    }
    assert {p: n for p, n in offenders.items() if n} == {}


def test_the_reader_never_imports_the_spool_writers():
    writers = (
        "megatron.core.dmi.sinks.sinks",
        "megatron.core.dmi.sinks.SpoolSink",
        "megatron.core.dmi.sinks.EmbeddedSink",
        "megatron.core.dmi.sinks.spool.SpoolWriter",
        "megatron.core.dmi.sinks.export",
    )
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(writers))
        for p in (CORE / "reader").rglob("*.py")
    }
    assert {p: n for p, n in offenders.items() if n} == {}


def test_the_record_key_is_a_leaf_without_torch_or_arrow():
    """The key is the bottom of the package: it imports no other DMI module (nothing cycles through
    it), and neither torch nor pyarrow (config and readers use it without paying for them)."""
    heavy = sorted(n for n in _imports(CORE / "key.py") if n.startswith(("torch", "pyarrow", "megatron.core.dmi.")))
    assert heavy == []
