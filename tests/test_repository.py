"""The repository itself: CI runs the README's test command, and every cited document exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("dmuon_compile", "passes", "kernels", "tests", "benchmarks", "docs", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".toml", ""}
# A document named in prose: docs/x.md, benchmarks/x.md or an upper-case NAME.md. A name after
# --out is a file a benchmark writes, not a citation.
CITATION = re.compile(r"(?<!--out )\b((?:docs/|benchmarks/)?[A-Za-z0-9_]+\.md)\b")
CITED_AS_DOCUMENT = re.compile(r"^(docs/|benchmarks/)|^[A-Z][A-Z0-9_]*\.md$")


def _texts():
    files = [p for p in ROOT.glob("*") if p.is_file() and p.suffix in {".md", ".toml"}]
    for folder in SOURCE_DIRS:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    for path in files:
        yield path, path.read_text(encoding="utf-8", errors="replace")


def missing_citations(text: str, here: Path) -> set[str]:
    """Documents ``text`` (a file in folder ``here``) cites that are not in the repository."""
    missing = set()
    for name in CITATION.findall(text):
        if not CITED_AS_DOCUMENT.search(name):
            continue
        candidates = [ROOT / name, here / name, ROOT / "docs" / name, ROOT / "benchmarks" / name]
        if not any(c.is_file() for c in candidates):
            missing.add(name)
    return missing


def test_every_cited_document_is_in_the_repository():
    found = {}
    for path, text in _texts():
        if path == Path(__file__).resolve():
            continue
        missing = missing_citations(text, path.parent)
        if missing:
            found[str(path.relative_to(ROOT))] = sorted(missing)
    assert not found, f"citations of documents that are not in the repository: {found}"


def test_missing_citation_check_has_teeth():
    text = "see DESIGN_NOTES.md and docs/nowhere.md; docs/architecture.md exists; --out OUT.md"
    assert missing_citations(text, ROOT) == {"DESIGN_NOTES.md", "docs/nowhere.md"}


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    at = readme.index("# the tests and the lint (what CI runs, .ci/run)")
    command = readme[at + 1]
    assert "ruff check ." in command and "ruff format --check ." in command and "pytest" in command
    assert command in ci


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    return readme[readme.index("# the tests and the lint (what CI runs, .ci/run)") + 1]


def test_the_test_command_installs_the_integrations_extras():
    """CI runs ``tests/integrations/`` rather than skipping it: the test command installs
    accelerate, transformers (≥ 5.25, which brings HF's ``kernels``), torchtitan and Triton, in
    one ``pip install`` (pyproject.toml's test extra says why one)."""
    command = _readme_test_command()
    assert command.count("pip install") == 1
    (extras,) = re.findall(r'pip install [^&]*-e "\.\[([a-z_,]+)\]"', command)
    extras = extras.split(",")
    assert {"test", "accelerate", "torchtitan"} <= set(extras)
    optional = _pyproject()["project"]["optional-dependencies"]
    requirements = [r for extra in extras for r in optional[extra]]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}
    assert {"accelerate", "transformers", "torchtitan", "triton"} <= names
    (transformers,) = [r for r in optional["test"] if r.startswith("transformers")]
    assert int(re.fullmatch(r"transformers>=5\.(\d+)", transformers).group(1)) >= 25


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_expression_with_its_file():
    """PEP 639: the license as an SPDX string plus license-files (setuptools deprecates the
    TOML table form and refuses a License classifier next to an expression)."""
    meta = _pyproject()
    project = meta["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"] and (ROOT / "LICENSE").is_file()
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+)", setuptools).group(1)) >= 77  # PEP 639 support


def test_numpy_is_listed_only_for_torch_and_the_reason_is_documented():
    """numpy is a dependency only so that ``import torch`` does not warn "Failed to initialize
    NumPy"; no module of the package imports it."""
    assert any(d.startswith("numpy") for d in _pyproject()["project"]["dependencies"])
    importing = [
        str(p.relative_to(ROOT))
        for folder in ("dmuon_compile", "passes", "kernels")
        for p in (ROOT / folder).rglob("*.py")
        if re.search(r"^\s*(import numpy|from numpy)", p.read_text(encoding="utf-8"), re.M)
    ]
    assert importing == []
    assert "Failed to initialize NumPy" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_quack_extra_is_declared():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("quack-kernels") for d in extras["quack"])


# ---------------------------------------------------------------------- the package's folders
#
# The guards below read every module the distribution installs: pyproject.toml maps the package
# onto three folders (``dmuon_compile/``, and ``passes/`` and ``kernels/`` at the checkout's
# root, installed as ``dmuon_compile.passes`` and ``dmuon_compile.kernels``).

PACKAGE_DIRS = {
    "dmuon_compile": "dmuon_compile",
    "passes": "dmuon_compile.passes",
    "kernels": "dmuon_compile.kernels",
}


def package_folders(pyproject: dict) -> dict[str, str]:
    """``{folder: package}`` of every folder the distribution installs: ``package-dir``'s
    entries, and each listed package's folder under its nearest mapped parent."""
    setuptools = pyproject["tool"]["setuptools"]
    mapping = dict(setuptools.get("package-dir", {}))
    folders = {folder: package for package, folder in mapping.items()}
    for package in setuptools.get("packages", []):
        parent = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
        rest = package[len(parent) :].lstrip(".").replace(".", "/")
        folder = mapping[parent] + ("/" + rest if rest else "")
        if not any(folder == f or folder.startswith(f + "/") for f in folders):
            folders[folder] = package
    return folders


def unscanned_folders(pyproject: dict, scanned: dict[str, str]) -> dict[str, str]:
    """The installed folders (with their package) that no entry of ``scanned`` covers."""
    return {
        folder: package
        for folder, package in package_folders(pyproject).items()
        if not any(folder == f or folder.startswith(f + "/") for f in scanned)
    }


def test_the_guards_scan_every_package_folder():
    meta = _pyproject()
    assert unscanned_folders(meta, PACKAGE_DIRS) == {}
    assert package_folders(meta) == PACKAGE_DIRS  # and the packages they are installed as
    scanned = {rel.split("/")[0] for rel, _, _ in package_modules()}
    assert scanned == set(PACKAGE_DIRS)


def test_the_package_folder_check_has_teeth():
    """The control: a package mapped onto a new folder is unscanned until PACKAGE_DIRS names
    it (as ``passes/`` and ``kernels/`` were)."""
    meta = _pyproject()
    planted = {"tool": {"setuptools": dict(meta["tool"]["setuptools"])}}
    setuptools = planted["tool"]["setuptools"]
    setuptools["package-dir"] = {**setuptools["package-dir"], "dmuon_compile.extra": "extra"}
    setuptools["packages"] = [*setuptools["packages"], "dmuon_compile.extra"]
    assert unscanned_folders(planted, PACKAGE_DIRS) == {"extra": "dmuon_compile.extra"}
    old = {"dmuon_compile": "dmuon_compile"}  # what the guards used to read
    assert set(unscanned_folders(meta, old)) == {"passes", "kernels"}


def package_modules():
    """``(path relative to the root, module name, text)`` of every module of the package."""
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder)
            parts = rel.parent.parts + (() if path.stem == "__init__" else (path.stem,))
            module = ".".join((package, *parts))
            if path.stem == "__init__":  # a package: relative imports resolve inside it
                module += ".__init__"
            yield path.relative_to(ROOT).as_posix(), module, path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------- the import graph


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the text of module ``module``) imports, absolute names, anywhere
    in the file (late imports inside functions included)."""
    import ast

    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y / from .. import y
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


# Muon: the optimizer and the three modules it is split into; the package root re-exports it.
MUON_MODULES = {
    "dmuon_compile/optimizer.py",
    "dmuon_compile/param_groups.py",
    "dmuon_compile/step_agreement.py",
    "dmuon_compile/between_steps.py",
}
# Above Muon (they use it): the package root, the framework integrations and the demo trainer.
ABOVE_MUON = ("dmuon_compile/__init__.py", "dmuon_compile/integrations/", "dmuon_compile/train/")


def muon_names() -> set[str]:
    """Muon's modules by name, and the names the package root re-exports from them
    (``from dmuon_compile import Muon`` imports the optimizer too)."""
    modules = {"dmuon_compile." + Path(rel).stem for rel in MUON_MODULES}
    root = (ROOT / "dmuon_compile" / "__init__.py").read_text(encoding="utf-8")
    names = set(modules)
    for name in imported_modules(root, "dmuon_compile.__init__"):
        for mod in modules:
            if name.startswith(mod + "."):
                names.add("dmuon_compile." + name.rsplit(".", 1)[1])
    return names


def optimizer_imports(modules) -> dict[str, list[str]]:
    """``{path: Muon's modules it imports}`` over ``(path, module, text)`` of modules below Muon
    (every module but Muon's and those of :data:`ABOVE_MUON`)."""
    muon = muon_names()
    found = {}
    for rel, module, text in modules:
        if rel in MUON_MODULES or rel.startswith(ABOVE_MUON):
            continue
        hits = sorted(imported_modules(text, module) & muon)
        if hits:
            found[rel] = hits
    return found


def test_the_runtime_does_not_import_the_optimizer():
    """One direction: the optimizer calls the runtime, never the reverse (routing rules, step
    phases and the runtime accessor live in modules below both). "The runtime": every module of
    the package below Muon (``distributed/``, ``passes/``, ``kernels/``, the step's modules);
    "the optimizer": Muon's four modules, and the root's re-exports of them."""
    offenders = optimizer_imports(package_modules())
    assert not offenders, offenders


def test_import_graph_check_has_teeth():
    late = "def f():\n    from dmuon_compile import optimizer as O\n"
    relative = "from ..optimizer import Muon\n"
    assert "dmuon_compile.optimizer" in imported_modules(
        late, "dmuon_compile.distributed._stages.tp"
    )
    assert "dmuon_compile.optimizer" in imported_modules(relative, "dmuon_compile.distributed.x")
    assert "dmuon_compile.optimizer" not in imported_modules(
        "from dmuon_compile.routing import route_model\n", "dmuon_compile.distributed.x"
    )
    planted = [
        ("dmuon_compile/distributed/x.py", "dmuon_compile.distributed.x", relative),
        ("kernels/x.py", "dmuon_compile.kernels.x", "from dmuon_compile import step_agreement\n"),
        ("passes/x.py", "dmuon_compile.passes.x", "from dmuon_compile import Muon\n"),
        (
            "dmuon_compile/layouts.py",
            "dmuon_compile.layouts",
            "import dmuon_compile.param_groups\n",
        ),
        ("dmuon_compile/integrations/x.py", "dmuon_compile.integrations.x", relative),
    ]
    assert set(optimizer_imports(planted)) == {p[0] for p in planted[:4]}


# The leaf utilities the kernels may import: they import nothing else of the package.
FLOOR_LEAVES = {"dmuon_compile.env", "dmuon_compile.log", "dmuon_compile._compat"}
KERNELS = "dmuon_compile.kernels"


def import_statements(source: str, module: str):
    """Each import of ``source`` as ``(base, names)``: ``import a.b`` is ``("a.b", ())``,
    ``from a import b, c`` is ``("a", ("b", "c"))``, a relative base resolved from ``module``."""
    import ast

    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def package_imports(source: str, module: str) -> set[str]:
    """The package's modules ``source`` imports: ``from dmuon_compile import env`` is
    ``dmuon_compile.env``; a bare ``import dmuon_compile`` is the package root."""
    out = set()
    for base, names in import_statements(source, module):
        if base == "dmuon_compile" and names:  # from the root: its submodules or its names
            out.update(f"{base}.{name}" for name in names)
        else:
            out.add(base)
    return {m for m in out if m == "dmuon_compile" or m.startswith("dmuon_compile.")}


def floor_violations(modules) -> dict[str, list[str]]:
    """``{path: modules above the floor it imports}``: a module of ``kernels/`` may import the
    kernels and :data:`FLOOR_LEAVES`; a leaf may import the other leaves only."""
    found = {}
    for rel, module, text in modules:
        kernel = rel.startswith("kernels/")
        if not (kernel or module in FLOOR_LEAVES):
            continue
        above = sorted(
            m
            for m in package_imports(text, module)
            if m not in FLOOR_LEAVES
            and not (kernel and (m == KERNELS or m.startswith(KERNELS + ".")))
        )
        if above:
            found[rel] = above
    return found


def test_the_kernels_import_nothing_above_them():
    """``kernels/`` is the floor: it imports no module of the package above it (the NS
    orthogonaliser, the kernel choice, the pass, the optimizer), only the leaf utilities,
    which import nothing else of the package."""
    violations = floor_violations(package_modules())
    assert not violations, violations


def test_the_floor_check_has_teeth():
    """The control: the loops the kernels used to have, planted back, are found."""
    late = "def f():\n    from dmuon_compile.newton_schulz import get_ns_backend\n"
    planted = [
        ("kernels/consistency.py", "dmuon_compile.kernels.consistency", late),
        (
            "kernels/autotune.py",
            "dmuon_compile.kernels.autotune",
            "from ..kernel_choice import x\n",
        ),
        ("kernels/x.py", "dmuon_compile.kernels.x", "import dmuon_compile\n"),
        ("kernels/y.py", "dmuon_compile.kernels.y", "from dmuon_compile import passes\n"),
        ("dmuon_compile/log.py", "dmuon_compile.log", "from dmuon_compile import routing\n"),
        ("dmuon_compile/env.py", "dmuon_compile.env", "from dmuon_compile.kernels import ops\n"),
    ]
    assert set(floor_violations(planted)) == {p[0] for p in planted}
    clean = [
        ("kernels/z.py", "dmuon_compile.kernels.z", "from dmuon_compile import env\n"),
        ("kernels/w.py", "dmuon_compile.kernels.w", "from .lower_tiles import TileConfig\n"),
        ("dmuon_compile/log.py", "dmuon_compile.log", "from dmuon_compile._compat import x\n"),
        ("passes/p.py", "dmuon_compile.passes.p", "from dmuon_compile import kernel_choice\n"),
    ]
    assert floor_violations(clean) == {}


# ------------------------------------------------------------------- no import circles


def module_files(modules) -> dict[str, str]:
    """``{module name: path}``; a package's name maps to its ``__init__.py``."""
    return {module.removesuffix(".__init__"): rel for rel, module, _ in modules}


def import_edges(modules) -> dict[str, set[str]]:
    """``{path: paths it imports}`` among ``modules`` (late imports and ``TYPE_CHECKING`` ones
    included: a layering holds for the reader too). A name imported from a module counts as
    that module. A package's ``__init__.py`` is its face: it only hands names on, so edges into
    and out of it are left out (as ``from dmuon_compile.distributed import x`` reads x)."""
    files = module_files(modules)

    def resolve(name: str) -> str | None:
        while name not in files and "." in name:
            name = name.rsplit(".", 1)[0]
        return files.get(name)

    edges: dict[str, set[str]] = {}
    for rel, module, text in modules:
        if rel.endswith("__init__.py"):
            continue
        targets = {resolve(m) for m in package_imports(text, module)}
        edges[rel] = {t for t in targets if t and t != rel and not t.endswith("__init__.py")}
    return edges


def room_of(rel: str) -> str:
    """The room a file belongs to: a top-level module of ``dmuon_compile`` is one, each folder
    below it (``distributed``, ``plan``, ...) and ``kernels``/``passes`` are one each."""
    parts = rel.split("/")
    if parts[0] != "dmuon_compile":
        return parts[0]
    return "/".join(parts[:2]) if len(parts) > 2 else rel


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected components of more than one
    node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def room_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for source, targets in edges.items():
        for target in targets:
            if room_of(source) != room_of(target):
                rooms.setdefault(room_of(source), set()).add(room_of(target))
    return rooms


def test_the_package_has_no_import_circles():
    """No two files import each other, directly or around a loop, and no two rooms do (a room:
    a top-level module, or a folder such as ``distributed/``): every arrow runs down, so each
    layer can be read, tested and replaced without the ones above it."""
    edges = import_edges(list(package_modules()))
    assert circles(edges) == []
    assert circles(room_edges(edges)) == []


def test_the_circle_check_has_teeth():
    """The control: the circles the package used to have, planted back, are found, late imports
    and ``TYPE_CHECKING`` imports included; an ``__init__.py`` re-export is not one."""
    late = "def f():\n    from dmuon_compile.newton_schulz import get_ns_backend\n"
    typed = (
        "if TYPE_CHECKING:\n"
        "    from dmuon_compile.distributed._stages.split_step import SplitGroup\n"
    )
    uses_plan = "from dmuon_compile.step_plan import TPStep\n"
    face, through_face = "from ._runtime import x\n", "from dmuon_compile.distributed import x\n"
    planted = [
        ("dmuon_compile/kernel_choice.py", "dmuon_compile.kernel_choice", late),
        (
            "dmuon_compile/newton_schulz.py",
            "dmuon_compile.newton_schulz",
            "from . import kernel_choice\n",
        ),
        ("dmuon_compile/step_plan.py", "dmuon_compile.step_plan", typed),
        (
            "dmuon_compile/distributed/_stages/split_step.py",
            "dmuon_compile.distributed._stages.split_step",
            "",
        ),
        (
            "dmuon_compile/distributed/_runtime/runtime.py",
            "dmuon_compile.distributed._runtime.runtime",
            uses_plan,
        ),
        ("dmuon_compile/distributed/__init__.py", "dmuon_compile.distributed.__init__", face),
        ("dmuon_compile/dedicate.py", "dmuon_compile.dedicate", through_face),
    ]
    edges = import_edges(planted)
    assert circles(edges) == [["dmuon_compile/kernel_choice.py", "dmuon_compile/newton_schulz.py"]]
    assert sorted(circles(room_edges(edges))) == [
        ["dmuon_compile/distributed", "dmuon_compile/step_plan.py"],
        ["dmuon_compile/kernel_choice.py", "dmuon_compile/newton_schulz.py"],
    ]
    assert "dmuon_compile/dedicate.py" not in room_edges(edges)  # only a face: no edge


# ------------------------------------------------------------ distributed/: its rooms in layers

# The private rooms of ``distributed/``, lowest first: a room's modules import no room after it.
# The public modules beside them are files of their own (the circle check above holds them).
DISTRIBUTED_ROOMS = ("_compat", "_comm", "_owner", "_stages", "_runtime")


def imported_names(source: str, module: str) -> set[str]:
    """Every dotted name ``source`` imports, late and relative imports included; ``from a import
    b`` gives ``a`` and ``a.b`` (``b`` may be a module of the package ``a``)."""
    out = set()
    for base, names in import_statements(source, module):
        out.add(base)
        out.update(f"{base}.{name}" for name in names)
    return out


def distributed_room(name: str) -> str | None:
    """The room of ``distributed/`` a module (or a name in one) is in; ``None`` outside them."""
    parts = name.split(".")
    if parts[:2] == ["dmuon_compile", "distributed"] and len(parts) > 2:
        return parts[2] if parts[2] in DISTRIBUTED_ROOMS else None
    return None


def upward_room_imports(modules) -> dict[str, list[str]]:
    """``{path: the rooms after its own it imports}`` over the modules of the rooms."""
    found = {}
    for rel, module, text in modules:
        room = distributed_room(module)
        if room is None:
            continue
        rank = DISTRIBUTED_ROOMS.index(room)
        rooms = {distributed_room(n) for n in imported_names(text, module)} - {None}
        above = sorted(r for r in rooms if DISTRIBUTED_ROOMS.index(r) > rank)
        if above:
            found[rel] = above
    return found


def test_the_distributed_rooms_are_layered():
    """torch's internals (``_compat/``), then the collectives and the pending queue
    (``_comm/``), the owner tensors (``_owner/``), the step's stages (``_stages/``) and the
    runtime (``_runtime/``): each room imports only the rooms before it."""
    folder = ROOT / "dmuon_compile" / "distributed"
    assert {p.parent.name for p in folder.glob("*/__init__.py")} == set(DISTRIBUTED_ROOMS)
    violations = upward_room_imports(package_modules())
    assert not violations, violations


def test_the_room_check_has_teeth():
    """The control: an import up the rooms is found however it is written (by module, late and
    relative, by name through the folder's face, for type checking only); down, none is."""
    planted = [
        (
            "dmuon_compile/distributed/_owner/tensor.py",
            "dmuon_compile.distributed._owner.tensor",
            "from dmuon_compile.distributed._runtime.runtime import DedicatedRuntime\n",
        ),
        (
            "dmuon_compile/distributed/_comm/pending.py",
            "dmuon_compile.distributed._comm.pending",
            "def f():\n    from .._owner import param\n",
        ),
        (
            "dmuon_compile/distributed/_stages/tp/param.py",
            "dmuon_compile.distributed._stages.tp.param",
            "from dmuon_compile.distributed import _runtime\n",
        ),
        (
            "dmuon_compile/distributed/_compat/fsdp.py",
            "dmuon_compile.distributed._compat.fsdp",
            "if TYPE_CHECKING:\n    from dmuon_compile.distributed._stages import split_step\n",
        ),
    ]
    assert set(upward_room_imports(planted)) == {p[0] for p in planted}
    clean = [
        (
            "dmuon_compile/distributed/_runtime/group.py",
            "dmuon_compile.distributed._runtime.group",
            "from dmuon_compile.distributed._owner import param\nfrom .. import step_plan\n",
        ),
        (
            "dmuon_compile/distributed/step_plan.py",
            "dmuon_compile.distributed.step_plan",
            "from dmuon_compile.distributed._stages import expert_shards\n",
        ),
    ]
    assert upward_room_imports(clean) == {}


# ---------------------------------------------------------------- DMUON_* variables: env.py

ENV_READ = re.compile(
    r"""(?:environ\.get|getenv)\(\s*["']DMUON_|environ\[\s*["']DMUON_|\benv_flag\("""
)
DMUON_NAME = re.compile(r"DMUON_[A-Z0-9_]+")
# Calls that write a variable (a launcher sets one for the runtime to read through env.py).
ENV_WRITES = {"setdefault", "setenv", "putenv"}


def dmuon_names_outside_writes(source: str) -> list[str]:
    """``DMUON_*`` names held as a whole string in code (a name read indirectly, e.g.
    ``SWITCH = "DMUON_X"; os.environ.get(SWITCH)``), except those a write passes."""
    import ast

    tree = ast.parse(source)
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ENV_WRITES:
                written.update(id(a) for a in node.args[:1])
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and DMUON_NAME.fullmatch(node.value)
        and id(node) not in written | docstrings
    ]


def env_readers(modules) -> dict[str, list[str]]:
    """``{path: what it reads}`` of the modules other than ``dmuon_compile/env.py`` that read a
    ``DMUON_*`` variable themselves (``log.py``: the generic switch reader, naming none)."""
    found = {}
    for rel, _, text in modules:
        if rel == "dmuon_compile/env.py":
            continue
        reads = [] if rel == "dmuon_compile/log.py" else ENV_READ.findall(text)
        reads += dmuon_names_outside_writes(text)
        if reads:
            found[rel] = sorted(set(reads))
    return found


def test_dmuon_variables_are_read_in_one_module():
    """``dmuon_compile/env.py`` reads (and documents) every ``DMUON_*`` variable of the
    package, the kernels' and the pass's included."""
    readers = env_readers(package_modules())
    assert not readers, readers


def test_the_env_check_has_teeth():
    assert ENV_READ.search('os.environ.get("DMUON_NS_KERNEL", "")')
    assert ENV_READ.search("record = env_flag(PROFILE_ENV, False)")
    planted = [
        # what passes/manager.py did
        ("passes/manager.py", "", "x = f\"{os.environ.get('DMUON_NS_KERNEL', '')}\"\n"),
        # what kernels/autotune.py did: the name in a constant, read through it
        ("kernels/autotune.py", "", 'S = "DMUON_SYRK_AUTOTUNE"\nos.environ.get(S, "")\n'),
        ("dmuon_compile/x.py", "", "flag = env_flag(SWITCH)\n"),
    ]
    assert set(env_readers(planted)) == {p[0] for p in planted}
    clean = [
        ("dmuon_compile/train/runtime.py", "", 'os.environ.setdefault("DMUON_X", "1")\n'),
        (
            "kernels/a.py",
            "",
            '"""``DMUON_CACHE_DIR`` in a docstring."""\nfrom dmuon_compile import env\n',
        ),
        ("dmuon_compile/c.py", "", 'raise ValueError("set DMUON_NS_KERNEL=cublas")\n'),
        ("dmuon_compile/env.py", "", 'NS = "DMUON_NS_KERNEL"\nos.environ.get(NS)\n'),
    ]
    assert env_readers(clean) == {}


# ------------------------------------------------------------ private torch APIs: compat modules

# Private torch APIs are read in the compat modules only (docs/torch_internals.md lists them).
# ``passes/`` (Inductor's CustomGraphPass and config, Dynamo's counters, torch._guards) and
# ``kernels/`` read theirs through ``dmuon_compile/_compat.py``: neither folder has its own.
COMPAT_MODULES = {
    "dmuon_compile/_compat.py",
    "dmuon_compile/distributed/_compat/dtensor.py",
    "dmuon_compile/distributed/_compat/fsdp.py",
    "dmuon_compile/distributed/_compat/autograd.py",
    "dmuon_compile/distributed/_compat/c10d.py",
}
PRIVATE_TORCH = re.compile(
    r"\btorch\._(?!foreach_|_)\w|\b_C\.|distributed_c10d\._|\._get_fsdp_state\b|"
    r"\._(?:local_tensor|spec|mp_policy|fsdp_param_groups?|get_root_mesh|concatenate|"
    r"execution_engine|get_backend|device_types)\b|\b_init_backend\b|\b_current_graph_task_id\b|"
    r"\b_getframe\b|\butils\._pytree\b|\b_NormPartial\b|\b_dtensor_spec\b|\b_calculate_correct_fan\b"
)


def code_without_strings(source: str) -> str:
    """``source``'s code tokens (no strings, comments or docstrings), dotted names kept whole."""
    import io
    import tokenize

    skip = {tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT}
    skip |= {tokenize.DEDENT, tokenize.ENDMARKER}
    skip |= {
        getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE") if hasattr(tokenize, n)
    }
    out, prev = [], ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        out.append(tok.string if "." in (tok.string, prev) else " " + tok.string)
        prev = tok.string
    return "".join(out)


def private_torch_uses(source: str) -> list[str]:
    return PRIVATE_TORCH.findall(code_without_strings(source))


def private_torch_readers(modules) -> dict[str, list[str]]:
    """``{path: private torch APIs it reads}`` of the modules that are not compat modules."""
    offenders = {}
    for rel, _, text in modules:
        if rel in COMPAT_MODULES:
            continue
        found = private_torch_uses(text)
        if found:
            offenders[rel] = sorted(set(found))
    return offenders


def test_private_torch_apis_are_read_in_the_compat_modules_only():
    offenders = private_torch_readers(package_modules())
    assert not offenders, (
        "private torch APIs outside the compat modules (read them through "
        f"dmuon_compile/_compat.py or distributed/_compat/): {offenders}"
    )
    assert all((ROOT / rel).is_file() for rel in COMPAT_MODULES)


def test_private_torch_check_has_teeth():
    text = (
        "x = t._local_tensor\nif torch._C._current_graph_task_id() != -1: pass\n"
        "g = dist.distributed_c10d._get_default_group()\nf = sys._getframe(1)\n"
        "s = module._get_fsdp_state()\nfrom torch.distributed.tensor._dtensor_spec import A\n"
    )
    assert all(private_torch_uses(line) for line in text.splitlines())
    clean = (
        '"""torch._inductor.config in a docstring"""\n# t._local_tensor in a comment\n'
        "torch._foreach_add_(a, b)\nx = self._spec_cache\nv = torch.__version__\n"
    )
    assert private_torch_uses(clean) == []
    planted = [  # what passes/manager.py and ns_rewrite.py read before
        ("passes/manager.py", "", "current = torch._inductor.config.post_grad_custom_pre_pass\n"),
        ("passes/ns_rewrite.py", "", "from torch._dynamo.utils import counters\n"),
        ("kernels/x.py", "", "from torch._inductor.custom_graph_pass import CustomGraphPass\n"),
        ("dmuon_compile/_compat.py", "", "import torch._inductor.config\n"),
    ]
    assert set(private_torch_readers(planted)) == {p[0] for p in planted[:3]}
