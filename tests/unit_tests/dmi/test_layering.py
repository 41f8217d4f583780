"""The package layering the architecture promises, checked on the source: ``megatron.core.dmi``
never imports ``megatron.training`` (any loop built on megatron-core can use it), every package
imports only packages below it (so the reader never imports the sinks, the configuration imports
no storage and no transport, nothing imports back up), and no modules import each other in a
circle. Imports are read from every ``import`` statement (at any depth, ``TYPE_CHECKING`` blocks
included) and from the lazy import tables that ``importlib.import_module`` reads."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
CORE = ROOT / "megatron" / "core" / "dmi"
PACKAGE = "megatron.core.dmi"

# The layers of megatron.core.dmi, bottom first: a package (or top-level module) imports only those
# of a lower layer. The pipeline's data flows key/records -> transport -> drain -> sinks -> store ->
# reader -> cli; the sinks and the reader both sit on the store, beside each other; config is
# usable by all but itself uses no storage and no transport.
LAYERS = [
    {"errors", "key"},
    {"upstream_patches"},
    {"records", "catalog", "provenance", "cpu_mode", "store_address", "validators"},
    {"config"},
    {"transport", "store"},
    {"capture", "sinks", "reader"},
    {"hooks", "drain", "replay"},
    {"session"},
    {"cli"},
    {"__main__"},
]
LEVEL = {room: i for i, layer in enumerate(LAYERS) for room in layer}

# Every module that imports by name at run time (importlib.import_module), and the module-level
# table its names come from: a dict (values) or a sequence of module names, each either absolute or
# a submodule of the package holding the table.
LAZY_TABLES = {
    "megatron.core.dmi.reader": "_MODULE_OF",
    "megatron.core.dmi.cli": "COMMAND_MODULES",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _calls_import_module(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "import_module"
        or isinstance(node, ast.Name)
        and node.id == "__import__"
        for node in ast.walk(tree)
    )


def _lazy_table(path: pathlib.Path, tree: ast.Module, table: str, package: str) -> set[str]:
    """The module names a lazy import table of ``package`` names, made absolute."""
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == table for t in targets):
            value = ast.literal_eval(node.value)
            names = value.values() if isinstance(value, dict) else value
            return {n if "." in n else f"{package}.{n}" for n in names}
    raise AssertionError(f"{path}: no module-level table {table}")


def _imports(path: pathlib.Path, module: str | None = None, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module name ``path`` (the source of ``module``) imports: its import statements
    (``from m import a`` names ``m.a``, and ``m`` unless every such name is one of ``modules``) and
    the lazy import table it reads, if any."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            full = {f"{node.module}.{a.name}" for a in node.names}
            names |= full
            if not full <= modules:  # ``from package import submodule`` imports the submodule
                names.add(node.module)
    if module in LAZY_TABLES:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names |= _lazy_table(path, tree, LAZY_TABLES[module], package)
    return names


def _core_files() -> list[pathlib.Path]:
    return sorted(CORE.rglob("*.py"))


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in _core_files()}


def _room(module: str) -> str:
    """The package or top-level module of megatron.core.dmi that ``module`` belongs to."""
    return module.removeprefix(PACKAGE + ".").split(".")[0]


def _module_graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of megatron.core.dmi it imports (a name that is not a module means its package)."""
    graph = {}
    for name, path in files.items():
        targets = set()
        for imported in _imports(path, name, frozenset(files)):
            while imported.startswith(PACKAGE + ".") and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported in files and imported != name and imported != PACKAGE:
                targets.add(imported)
        graph[name] = targets
    return graph


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        if module == PACKAGE:
            continue
        for target in targets:
            a, b = _room(module), _room(target)
            if a != b and LEVEL[b] >= LEVEL[a]:
                bad.append(f"{module} -> {target} ({a} is layer {LEVEL[a]}, {b} is layer {LEVEL[b]})")
    return sorted(bad)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_core_never_imports_megatron_training():
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("megatron.training"))
        for p in _core_files()
    }
    assert {p: n for p, n in offenders.items() if n} == {}


def test_every_package_has_a_layer():
    assert {_room(m) for m in _modules() if m != PACKAGE} <= set(LEVEL)


def test_lazy_import_tables_are_all_known():
    """A module that imports by name must declare its table here, or its imports go unchecked."""
    lazy = {m for m, p in _modules().items() if _calls_import_module(ast.parse(p.read_text()))}
    lazy.discard("megatron.core.dmi.cli.read")  # __import__("pandas"): not a DMI module
    lazy.discard("megatron.core.dmi.upstream_patches")  # megatron's own modules: its TARGETS, checked below
    assert lazy == set(LAZY_TABLES)


def test_upstream_patches_import_only_megatrons_own_modules():
    """The touch-point table imports its targets' modules by name: none of them may be DMI's (that
    would be an import the layering checks cannot see)."""
    from megatron.core.dmi.upstream_patches import TARGETS

    assert TARGETS and not [t.module for t in TARGETS if t.module.startswith(PACKAGE)]


def test_packages_import_only_layers_below():
    assert _upward_imports(_module_graph(_modules())) == []


def test_no_modules_import_each_other_in_a_circle():
    assert _circles(_module_graph(_modules())) == []


@pytest.mark.parametrize(
    "room,imports",
    [
        ("reader", "megatron.core.dmi.sinks.spool"),  # the reader never imports a sink
        ("config", "megatron.core.dmi.store.schema"),  # config never imports storage
        ("config", "megatron.core.dmi.transport.abi"),  # ... nor the ring's ABI
        ("store", "megatron.core.dmi.reader.store"),  # an arrow back up
        ("validators", "megatron.core.dmi.config"),  # the torch-free commands' checks never import config
    ],
)
def test_a_forbidden_import_is_caught(tmp_path, room, imports):
    """The checks fail on a violation: one added import, in a module of the package, is reported."""
    files = _modules()
    victim = next(m for m in sorted(files) if _room(m) == room)
    copy = tmp_path / files[victim].name
    copy.write_text(files[victim].read_text() + f"\nimport {imports}\n")
    graph = _module_graph({**files, victim: copy})
    assert any(line.startswith(f"{victim} -> {imports}") for line in _upward_imports(graph))


def test_a_lazy_table_entry_is_checked_too(tmp_path):
    """A name in a lazy import table counts as an import: the reader's table naming a sink is caught."""
    files = _modules()
    reader = "megatron.core.dmi.reader"
    copy = tmp_path / "__init__.py"
    copy.write_text(
        files[reader]
        .read_text()
        .replace("_MODULE_OF = {", '_MODULE_OF = {\n    "SpoolSink": "megatron.core.dmi.sinks.sinks",', 1)
    )
    assert _upward_imports(_module_graph(files)) == []
    assert any(
        line.startswith(f"{reader} -> megatron.core.dmi.sinks.sinks")
        for line in _upward_imports(_module_graph({**files, reader: copy}))
    )


def test_a_circle_is_caught():
    graph = _module_graph(_modules())
    graph["megatron.core.dmi.store.schema"] = graph["megatron.core.dmi.store.schema"] | {
        "megatron.core.dmi.store.backend"
    }
    assert ["megatron.core.dmi.store.backend", "megatron.core.dmi.store.schema"] in _circles(graph)


def test_the_record_key_is_a_leaf_without_torch_or_arrow():
    """The key is the bottom of the package: it imports no other DMI module (nothing cycles through
    it), and neither torch nor pyarrow (config and readers use it without paying for them)."""
    heavy = sorted(n for n in _imports(CORE / "key.py") if n.startswith(("torch", "pyarrow", "megatron.core.dmi.")))
    assert heavy == []


def test_the_shared_validators_import_no_torch():
    """``megatron-dmi ingest`` checks its values with them and never imports torch (config does)."""
    imported = _imports(CORE / "validators.py")
    assert sorted(n for n in imported if n.startswith(("torch", "megatron.core.dmi.config"))) == []
