"""The package's shape, read from its source (no import runs): the import graph of ``ds_odc/`` has no cycle and no
arrow from a lower layer up into a higher one, the top of the package holds the public face only, every module says
what it exports (``__all__``), and no module takes another module's private name.

Every import counts, the ones inside functions too: an import deferred to call time is still a dependency.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ds_odc"

# Lower layers know nothing of higher ones. The public face (``ds_odc/__init__``, ``__main__``) sits on top and
# imports everything lazily (inside functions); ``config`` lives at the top for users but depends only on DeepSpeed.
LAYERS = {
    "ds_odc.balancer": 0,  # pure Python + numpy: a leaf
    "ds_odc.ops": 1,
    "ds_odc.config": 1,
    "ds_odc.zero": 2,
    "ds_odc.training": 3,
    "ds_odc.integrations": 4,
    "ds_odc.recipes": 4,
    "ds_odc.cli": 5,
    "ds_odc.__main__": 6,
    "ds_odc": 6,
}
# ``import ds_odc`` inside the package is for these only: ``patch()`` installs zero/ and config, so such an import
# counts as one of the zero layer.
ROOT_ATTRIBUTES_INSIDE = {"patch", "__version__", "__file__"}
ROOT_AS_IMPORTED = LAYERS["ds_odc.zero"]
TOP_MODULES = {"__init__.py", "__main__.py", "config.py"}

# Private names passed between modules and import cycles still waiting for a cleanup; each entry must still occur.
PENDING_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()
PENDING_CYCLES: set[tuple[str, ...]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of ds_odc
    name: str | None  # the name taken from it (``from target import name``), None for ``import target``
    lineno: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _function_lines(tree: ast.Module) -> set[int]:
    return {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}


@functools.cache
def _imports() -> tuple[Import, ...]:
    modules, found = _modules(), []
    for name, tree in modules.items():
        is_package = name == "ds_odc" or (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
        deferred = _function_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "ds_odc":
                        found.append(Import(name, alias.name, None, node.lineno, node.lineno in deferred))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[:len(name.split(".")) - node.level + is_package]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "ds_odc":
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:  # ``from package import module``
                        found.append(Import(name, submodule, None, node.lineno, node.lineno in deferred))
                    else:
                        found.append(Import(name, source, alias.name, node.lineno, node.lineno in deferred))
    return tuple(found)


def _layer(module: str) -> int:
    owner = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[owner]


def _where(i: Import) -> str:
    return f"{i.importer}:{i.lineno} imports {i.target}" + (f".{i.name}" if i.name else "")


def test_the_graph_sees_every_kind_of_import():
    """The parser behind the other checks: relative, deferred and ``from package import module`` imports."""
    edges = {(i.importer, i.target, i.in_function) for i in _imports()}
    assert ("ds_odc.balancer.fit", "ds_odc.balancer.lsq", False) in edges  # from .lsq import ...
    assert ("ds_odc", "ds_odc.zero.optimizer", True) in edges  # inside patch()
    assert ("ds_odc.zero.optimizer", "ds_odc.zero._deepspeed_privates", False) in edges  # from ds_odc.zero import _x


def _cycles() -> set[tuple[str, ...]]:
    graph: dict[str, set[str]] = {}
    for i in _imports():
        if i.target != i.importer:
            graph.setdefault(i.importer, set()).add(i.target)
    found, done, path = set(), set(), []

    def visit(node):
        if node in path:
            cycle = path[path.index(node):]
            first = cycle.index(min(cycle))
            found.add(tuple(cycle[first:] + cycle[:first]))
            return
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    return found


def _assert_only_pending(found: set, pending: set, what: str, fix: str, name: str) -> None:
    """``found`` holds nothing beyond ``pending``, and everything in ``pending`` still occurs (else it is stale)."""
    assert not found - pending, f"{what}: {sorted(found - pending)}; {fix}"
    assert not pending - found, f"{sorted(pending - found)} no longer occur: remove them from {name}"


def test_no_import_cycle():
    _assert_only_pending(_cycles(), PENDING_CYCLES, "modules that import each other (directly or around a loop)",
                         "move what both need into a module below them", "PENDING_CYCLES")


def test_no_import_runs_up_a_layer():
    upward = []
    for i in _imports():
        if i.importer in ("ds_odc", "ds_odc.__main__"):
            continue  # the public face: may import any layer, lazily (checked below)
        target_layer = ROOT_AS_IMPORTED if i.target == "ds_odc" else _layer(i.target)
        if target_layer > _layer(i.importer):
            upward.append(_where(i))
    assert not upward, ("imports from a lower layer into a higher one (balancer < ops, config < zero < training < "
                        f"integrations, recipes < cli < the public face): {upward}")


def test_the_public_face_imports_lazily_and_is_used_inside_only_for_patch():
    eager = [_where(i) for i in _imports() if i.importer in ("ds_odc", "ds_odc.__main__") and not i.in_function]
    assert not eager, f"the package's top imports these at import time, so `import ds_odc` would load them: {eager}"
    leaf = [_where(i) for i in _imports() if i.importer.startswith("ds_odc.balancer")
            and not i.target.startswith("ds_odc.balancer")]
    assert not leaf, f"the balancer is a leaf (pure Python, used by the rest): {leaf}"
    for name, tree in _modules().items():
        if name == "ds_odc" or not any(i.importer == name and i.target == "ds_odc" and i.name is None
                                       for i in _imports()):
            continue
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "ds_odc"}
        assert used <= ROOT_ATTRIBUTES_INSIDE, (f"{name} uses ds_odc.{sorted(used - ROOT_ATTRIBUTES_INSIDE)}: import "
                                                "it from the module that defines it")


def test_at_most_four_modules_at_the_top():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert len(top) <= 4 and top == TOP_MODULES, (f"the top of ds_odc/ holds the public face only ({sorted(TOP_MODULES)}"
                                                  f"); found {sorted(top)}: put the others in a package")


def _literals(tree: ast.Module) -> dict[str, object]:
    """Module-level ``NAME = <literal>`` assignments."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return found


def _all_of(tree: ast.Module) -> list[str] | None:
    """``__all__``: a list of strings, or of strings and ``*NAME`` of a literal (the top's lazy exports)."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            names = []
            for item in node.value.elts:
                names.extend(_literals(tree)[item.value.id] if isinstance(item, ast.Starred) else [item.value])
            return names
    return None


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_module_says_what_it_exports():
    problems = []
    for name, tree in _modules().items():
        exported = _all_of(tree)
        if exported is None:
            problems.append(f"{name} has no __all__")
            continue
        defined = _defined(tree)
        if "__getattr__" in defined:  # a lazy package: its names are the keys of the table its __getattr__ reads
            defined |= {k for v in _literals(tree).values() if isinstance(v, dict) for k in v}
        missing = set(exported) - defined
        private = [n for n in exported if n.startswith("_") and not n.startswith("__")]
        if missing or private or len(set(exported)) != len(exported):
            problems.append(f"{name}.__all__: not defined {sorted(missing)}, private {private}, or repeated")
    assert not problems, problems


def _private_imports() -> set[tuple[str, str, str]]:
    """(importer, module, name) for every underscore name taken from another module, and every underscore module
    imported from outside the package that holds it (its package and the packages above it may use it)."""
    found = set()
    for i in _imports():
        if i.name is not None and i.name.startswith("_") and i.target != i.importer:
            found.add((i.importer, i.target, i.name))
        parts = i.target.split(".")
        for depth, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                package = ".".join(parts[:depth])
                if not (i.importer == package or i.importer.startswith(package + ".")
                        or package.startswith(i.importer + ".")):
                    found.add((i.importer, package, part))
    return found


def test_no_private_name_crosses_modules():
    _assert_only_pending(_private_imports(), PENDING_PRIVATE_IMPORTS, "private names taken from another module",
                         "make them public (in the module's __all__) or keep the code that needs them in one module",
                         "PENDING_PRIVATE_IMPORTS")


# What modules outside ds_odc/zero/ may use of an engine's optimizer: nothing (its public members, documented on
# OdcOptimizer, are read through ds_odc/zero/engine.py). Everything it holds (its OdcState ``odc``, DeepSpeed's
# buffers and groups, private names) is for ds_odc.zero only; to ask for more, add a function that takes the engine
# to ds_odc/zero/engine.py.
OPTIMIZER_SURFACE: set[str] = set()
ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}


def _is_optimizer(node: ast.AST) -> bool:
    """A name or attribute that says it holds an optimizer (``optimizer``, ``x.optimizer``, ``self.ds_optimizer``)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "optimizer" in name.lower()


def _optimizer_reaches(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute read, written or looked up by name on an optimizer in ``tree``:
    ``engine.optimizer.x``, ``optimizer._x``, ``getattr(engine.optimizer, "x", default)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_optimizer(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS
              and len(node.args) >= 2 and _is_optimizer(node.args[0])):
            name = node.args[1]
            found.append((node.lineno, name.value if isinstance(name, ast.Constant) else ast.unparse(name)))
    return sorted(found)


def test_the_optimizer_check_sees_every_kind_of_reach():
    snippet = ast.parse("engine.optimizer.odc.groups\noptimizer._flag = 1\ngetattr(engine.optimizer, 'fp16_groups')\n"
                        "hasattr(self.ds_optimizer, name)\nengine.optimizer.odc_wait_s\nengine.module.odc\n")
    assert _optimizer_reaches(snippet) == [(1, "odc"), (2, "_flag"), (3, "fp16_groups"), (4, "name"),
                                           (5, "odc_wait_s")]


def test_the_optimizer_surface_is_documented_on_the_optimizer():
    tree = _modules()["ds_odc.zero.optimizer"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OdcOptimizer")
    documented = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)}
    assert OPTIMIZER_SURFACE <= documented, f"not documented members of OdcOptimizer: {OPTIMIZER_SURFACE - documented}"


def test_nothing_outside_zero_reaches_into_the_optimizer():
    reaches = [f"{name}:{line} uses optimizer.{attr}" for name, tree in _modules().items()
               if not (name == "ds_odc.zero" or name.startswith("ds_odc.zero."))
               for line, attr in _optimizer_reaches(tree) if attr not in OPTIMIZER_SURFACE]
    assert not reaches, (f"{reaches}: outside ds_odc/zero/ use only {sorted(OPTIMIZER_SURFACE)} of the optimizer, or a "
                         "function of ds_odc.zero.engine that takes the engine (add one there if you need more)")


def _clashing_test_modules(paths: list[Path]) -> dict[str, list[str]]:
    """Test files that share a basename: pytest imports test modules by basename (the test folders are not packages),
    so the second one fails to collect on a clean checkout ("import file mismatch")."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        by_name.setdefault(path.name, []).append(str(path))
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def test_test_modules_have_distinct_names():
    planted = [Path("tests/a/test_x.py"), Path("tests/b/test_x.py"), Path("tests/b/test_y.py")]
    assert _clashing_test_modules(planted) == {"test_x.py": ["tests/a/test_x.py", "tests/b/test_x.py"]}
    tests = Path(__file__).resolve().parent
    clashes = _clashing_test_modules(sorted(tests.rglob("test_*.py")))
    assert not clashes, f"rename one of each: {clashes}"


# -- the DeepSpeed seams call down (see [Note: seams call down] in ds_odc/zero/_deepspeed_privates.py) -----------------
# A seam class overrides members of one DeepSpeed class (its entry in SEAM_CLASSES) and is inherited by an ODC
# subclass; what it uses of ``self`` must be its own (defined or declared in its body) or DeepSpeed's, never a method
# or attribute that only the subclass deriving from it defines: such a call runs upward, where no import shows it.
PRIVATES = "ds_odc.zero._deepspeed_privates"


def _deepspeed_source(module: str) -> Path | None:
    """The source file of a DeepSpeed module, found without importing DeepSpeed."""
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")  # a top-level name: nothing is executed
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _class_members(cls: ast.ClassDef) -> set[str]:
    """Names a class body defines (methods, class attributes, annotations) and attributes its methods set on self."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


@functools.cache
def _deepspeed_members(module: str, name: str) -> frozenset[str]:
    """Members of DeepSpeed's class ``module.name`` and of its DeepSpeed base classes, read from their source."""
    path = _deepspeed_source(module)
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    members = _class_members(cls)
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deepspeed"):
            imported.update({a.asname or a.name: (node.module, a.name) for a in node.names})
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in imported:
            members |= _deepspeed_members(*imported[base.id])
        elif isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            members |= _deepspeed_members(module, base.id)
    return frozenset(members)


def _upward_reaches(tree: ast.Module, seam_classes: dict) -> list[str]:
    """``Class.method: self.name`` for every use of ``self`` in a seam class that neither the class nor the DeepSpeed
    class it overrides for defines; also every class of ``tree`` missing from ``seam_classes``."""
    found = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name not in seam_classes:
            found.append(f"{cls.name}: not in SEAM_CLASSES")
            continue
        known = _class_members(cls) | _deepspeed_members(*seam_classes[cls.name])
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                        and node.attr not in known and not node.attr.startswith("__")):
                    found.append(f"{cls.name}.{fn.name}: self.{node.attr}")
    return sorted(set(found))


def test_the_seam_check_sees_a_call_up_into_the_subclass():
    seams = _literals(_modules()[PRIVATES])["SEAM_CLASSES"]
    planted = ast.parse(
        "class Stage3Seams:\n"
        "    odc: OdcState\n"
        "    def partition_grads(self, params, partitions):\n"
        "        self.release_full_gradients(params)  # only OdcOptimizer defines it\n"
        "        self.odc.free_pushed_gradients(params)  # a declared collaborator\n"
        "        self.helper_flag = self._get_param_partition_group(params[0])  # DeepSpeed's own; set here\n"
        "        return self.fp16_groups, self.helper_flag, self.__dict__\n"
        "class Helper:\n"
        "    pass\n")
    assert _upward_reaches(planted, seams) == ["Helper: not in SEAM_CLASSES",
                                               "Stage3Seams.partition_grads: self.release_full_gradients"]


def test_seam_classes_call_no_method_of_their_subclasses():
    seams = _literals(_modules()[PRIVATES])["SEAM_CLASSES"]
    assert set(seams) == {"Stage3Seams", "CoordinatorSeams"}
    upward = _upward_reaches(_modules()[PRIVATES], seams)
    assert not upward, (f"{upward}: a seam class in _deepspeed_privates.py uses what only the class deriving from it "
                        "defines; forward to a collaborator the seam class declares (see [Note: seams call down])")


# -- one answer to "is ODC on?" -----------------------------------------------------------------------------------------
# Outside ds_odc/zero/ (and the config model), whether an engine or a config runs ODC, and what its step waited, is
# asked of ds_odc.zero.engine (is_odc, odc_requested, wait_seconds, lockstep_waits, resident_parameters, ...), never
# by the optimizer's type, its attributes or the config's ``enabled``. The public face installs the optimizer class.
ODC_OPTIMIZER_NAMES = {"OdcOptimizer"}
ODC_STATE_ATTRIBUTES = {"odc_wait_s", "odc_lockstep", "odc_host_step_times", "odc_resident"}
ODC_PREDICATE_OWNERS = ("ds_odc.zero", "ds_odc.config")
OPTIMIZER_CLASS_INSTALLERS = {"ds_odc"}  # patch() hands OdcOptimizer to DeepSpeed's optimizer hook


def _odc_questions(tree: ast.Module, installs: bool = False) -> list[tuple[int, str]]:
    """(line, what) for every way of asking whether ODC is on, or for its state, other than ds_odc.zero.engine's."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ODC_OPTIMIZER_NAMES and not installs:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name in ODC_OPTIMIZER_NAMES and not installs:
            found.append((getattr(node, "lineno", 0), f"import {node.name}"))
        elif isinstance(node, ast.Attribute) and node.attr in ODC_STATE_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in ODC_STATE_ATTRIBUTES:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Attribute) and node.attr == "enabled":
            owner = node.value
            if ((isinstance(owner, ast.Name) and owner.id == "odc") or (isinstance(owner, ast.Attribute)
                                                                         and owner.attr == "odc")
                    or (isinstance(owner, ast.Call) and "odc_config_from_ds_config" in ast.unparse(owner.func))):
                found.append((node.lineno, f"{ast.unparse(owner)}.enabled"))
    return sorted(found)


def test_the_odc_question_check_sees_every_way_of_asking():
    planted = ast.parse("from ds_odc.zero.optimizer import OdcOptimizer\n"
                        "isinstance(engine.optimizer, OdcOptimizer)\n"
                        "getattr(engine.optimizer, 'odc_wait_s', 0.0)\n"
                        "engine.optimizer.odc_lockstep\n"
                        "odc_config_from_ds_config(config).enabled\n"
                        "config.zero_config.odc.enabled\n"
                        "odc.enabled\n"
                        "self.odc_runner.enabled and is_odc(engine) and odc_requested(config)\n")
    assert [w for _, w in _odc_questions(planted)] == [
        "import OdcOptimizer", "OdcOptimizer", "'odc_wait_s'", "odc_lockstep", "odc_config_from_ds_config(config).enabled",
        "config.zero_config.odc.enabled", "odc.enabled"]


def test_one_answer_to_is_odc_on_outside_zero():
    asked = [f"{name}:{line} {what}" for name, tree in _modules().items()
             if not any(name == p or name.startswith(p + ".") for p in ODC_PREDICATE_OWNERS)
             for line, what in _odc_questions(tree, installs=name in OPTIMIZER_CLASS_INSTALLERS)]
    assert not asked, (f"{asked}: ask ds_odc.zero.engine (is_odc(engine), odc_requested(ds_config), wait_seconds, "
                       "lockstep_waits, resident_parameters; add a function there if you need more)")


# -- each balancer option's rule written once ------------------------------------------------------------------------
# The microbatch budget and the oversize policy are checked by their owners in ds_odc/balancer/plan.py, which every
# way in calls (BalancerOptions, the sampler, the planners, the ds_config's balancer block, the SFT flags); the tuple
# of policies is written once, there, and the others name it (``choices=OVERSIZE_POLICIES``,
# ``Literal[OVERSIZE_POLICIES]``).
BALANCER_RULE_OWNERS = {("ds_odc.balancer.plan", "check_max_tokens"), ("ds_odc.balancer.plan", "check_oversize"),
                        ("ds_odc.balancer.plan", "OVERSIZE_POLICIES")}
RULE_TEXTS = ("max_tokens must", "unknown oversize policy")


def _budget_name(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.endswith("max_tokens")


def _balancer_rules(tree: ast.Module, module: str = "") -> list[tuple[int, str]]:
    """(line, what) for each place ``tree`` writes the rule of ``max_tokens`` or of the oversize policy itself, out
    of the owners': a test of membership in ``OVERSIZE_POLICIES``; the policies spelt out together (a tuple, list or
    set, a ``Literal``'s); a ``max_tokens`` compared with 0 or 1; a ``max_tokens`` typed ``PositiveInt`` or given a
    bound in ``Field``; either rule's error text."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (module, node.name) in BALANCER_RULE_OWNERS:
            return
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and (module, node.targets[0].id) in BALANCER_RULE_OWNERS):
            return
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if (any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                    and any("OVERSIZE_POLICIES" in ast.unparse(side) for side in node.comparators)):
                found.append((node.lineno, "membership in OVERSIZE_POLICIES"))
            elif (any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops)
                  and any(_budget_name(side) for side in sides)
                  and any(isinstance(side, ast.Constant) and side.value in (0, 1) for side in sides)):
                found.append((node.lineno, f"a bound on the budget: {ast.unparse(node)}"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            words = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if {"error", "truncate", "skip"} <= words:
                found.append((node.lineno, f"the oversize policies spelt out: {ast.unparse(node)}"))
        elif isinstance(node, ast.AnnAssign) and _budget_name(node.target):
            typed = ast.unparse(node.annotation) + (ast.unparse(node.value) if node.value is not None else "")
            if re.search(r"PositiveInt|conint|\b(gt|ge)=", typed):
                found.append((node.lineno, f"a budget typed with its bound: {ast.unparse(node)}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and any(t in node.value for t in RULE_TEXTS):
            found.append((node.lineno, f"the rule's error text: {node.value[:40]!r}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return sorted(set(found))


def test_the_rule_check_sees_every_way_of_writing_a_balancer_rule():
    planted = ast.parse("if oversize not in OVERSIZE_POLICIES:\n"
                        "    raise ValueError(f'unknown oversize policy {oversize!r}')\n"
                        "if max_tokens is not None and max_tokens < 1:\n"
                        "    raise ValueError(f'max_tokens must be a positive int, got {max_tokens}')\n"
                        "if 0 >= self.max_tokens: pass\n"
                        "ap.add_argument('--oversize', choices=['error', 'truncate', 'skip'])\n"
                        "class C:\n"
                        "    oversize: Literal['error', 'truncate', 'skip'] = 'error'\n"
                        "    max_tokens: Optional[PositiveInt] = None\n"
                        "    other_max_tokens: int = Field(None, gt=0)\n"
                        "def check_oversize(value):\n"  # an owner's name, in a module that does not own it
                        "    return value in OVERSIZE_POLICIES\n"
                        "OVERSIZE_POLICIES = ('error', 'truncate', 'skip')\n"
                        "ok = [max_tokens == 1, oversize == 'skip', max_tokens > 2, ('error', 'skip'),"
                        " Literal[OVERSIZE_POLICIES], check_max_tokens(max_tokens)]\n")
    assert [line for line, _ in _balancer_rules(planted, "ds_odc.elsewhere")] == [1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 13]
    owned = [line for line, _ in _balancer_rules(planted, "ds_odc.balancer.plan")]
    assert 12 not in owned and 13 not in owned and 1 in owned  # the owners' own code is theirs to write


def test_each_balancer_option_rule_is_written_once():
    plan = _modules()["ds_odc.balancer.plan"]
    defined = {n.name for n in plan.body if isinstance(n, ast.FunctionDef)} | _defined(plan)
    assert {name for _, name in BALANCER_RULE_OWNERS} <= defined, "the rules' owners moved: update BALANCER_RULE_OWNERS"
    written = [f"{name}:{line} {what}" for name, tree in _modules().items() for line, what in _balancer_rules(tree, name)]
    assert not written, (f"{written}: the budget's and the oversize policy's rules are written once, in "
                         "ds_odc.balancer.plan: call check_max_tokens / check_oversize, or name OVERSIZE_POLICIES")


# -- compiled blocks without DeepSpeed --------------------------------------------------------------------------------
DEEPSPEED_FREE = ("ds_odc.training.compile", "ds_odc.training.blocks")  # FSDP2 and plain training use them too


def _reachable(module: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _deepspeed_importers(modules: dict[str, ast.Module]) -> set[str]:
    return {name for name, tree in modules.items() for node in ast.walk(tree)
            if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" for a in node.names))
            or (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "deepspeed")}


def _deepspeed_reached(module: str, modules: dict[str, ast.Module], edges) -> list[str]:
    graph: dict[str, set[str]] = {}
    for importer, target in edges:
        graph.setdefault(importer, set()).add(target)
    return sorted(({module} | _reachable(module, graph)) & _deepspeed_importers(modules))


def test_the_deepspeed_free_check_follows_imports():
    planted = {"a": ast.parse("import b"), "b": ast.parse("from deepspeed.utils import logger"), "c": ast.parse("")}
    assert _deepspeed_reached("a", planted, [("a", "b")]) == ["b"]
    assert _deepspeed_reached("c", planted, [("a", "b")]) == []


def test_compiled_blocks_import_no_deepspeed():
    edges = [(i.importer, i.target) for i in _imports() if i.target != "ds_odc"]
    for module in DEEPSPEED_FREE:
        reached = _deepspeed_reached(module, _modules(), edges)
        assert not reached, f"{module} imports DeepSpeed through {reached}: keep it free of DeepSpeed (and of zero/)"

# Transformers', Accelerate's and TRL's privates that ds_odc uses are registered, with a reason each, in
# ds_odc/integrations/_hf_privates.py, which alone reads or writes them (through its accessors). An override may
# define such a method and call its stock version, ``super().<name>(...)``, inside itself. The balancer never touches
# a trainer (a leaf: numpy only), and its sampler's own ``_step`` is its own.
HF_PRIVATES_MODULE = "ds_odc.integrations._hf_privates"
HF_PRIVATES_EXEMPT = ("ds_odc.balancer",)


def _registered_hf_privates() -> set[str]:
    """The names registered in ``_hf_privates``: keys of its ``*_PRIVATES`` dicts (``save_model(_internal_call)``:
    ``save_model``; ``GradientState._set_sync_gradients``: ``_set_sync_gradients``) and ``INSTANCE_ATTRIBUTES``."""
    names = set()
    for node in _modules()[HF_PRIVATES_MODULE].body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        target = node.targets[0].id
        if target.endswith("_PRIVATES") and isinstance(node.value, ast.Dict):
            names |= {k.value.partition("(")[0].rpartition(".")[2] for k in node.value.keys}
        elif target == "INSTANCE_ATTRIBUTES":
            names |= {e.value for e in node.value.elts}
    return names


def _hf_private_reaches(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for every read or write of a registered name in ``tree`` (``x.name``, ``getattr(x, "name")``),
    but ``super().name`` inside a function of that name (an override calling its stock version)."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in names:
            is_super = (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                        and node.value.func.id == "super")
            if not (is_super and function == node.attr):
                found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append((node.lineno, node.args[1].value))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return sorted(found)


def test_the_hf_private_check_sees_every_kind_of_reach():
    names = {"_metrics", "_prepare_inputs", "router_aux_loss_coef"}
    snippet = ast.parse("self._metrics['train'] = {}\n"
                        "getattr(model, 'router_aux_loss_coef', None)\n"
                        "class T:\n"
                        "    def _prepare_inputs(self, inputs):\n"
                        "        return super()._prepare_inputs(inputs)\n"  # an override's stock call: allowed
                        "    def odc_loss(self, model, mb):\n"
                        "        return super()._prepare_inputs(mb) + self._prepare_inputs(mb)\n"
                        "trainer._metrics\n")
    assert _hf_private_reaches(snippet, names) == [(1, "_metrics"), (2, "router_aux_loss_coef"),
                                                   (7, "_prepare_inputs"), (7, "_prepare_inputs"), (8, "_metrics")]
    assert {"_prepare_inputs", "save_model", "_set_sync_gradients", "_metrics", "_step"} <= _registered_hf_privates()


def test_hf_privates_only_through_their_accessors():
    names = _registered_hf_privates()
    reaches = [f"{name}:{line} uses .{attr}" for name, tree in _modules().items()
               if name != HF_PRIVATES_MODULE and not name.startswith(HF_PRIVATES_EXEMPT)
               for line, attr in _hf_private_reaches(tree, names)]
    assert not reaches, (f"{reaches}: read or write these Transformers / Accelerate / TRL names through an accessor "
                         f"of {HF_PRIVATES_MODULE} (add one there, next to the entry that says why)")


# -- a small public surface ---------------------------------------------------------------------------------------------
# ``__all__`` lists what users import (docs/, README.md, examples/, benchmarks/) and a module's documented API; names
# that only other ds_odc modules or the tests use stay importable but out of ``__all__``. A private module (its file
# name starts with ``_``) exports nothing. Measured: 127 names across 84 modules (498 before the surface was cut).
MAX_EXPORTED = 144


def _exported_count(modules: dict[str, ast.Module]) -> int:
    return sum(len(_all_of(tree) or []) for tree in modules.values())


def _private_modules_exporting(modules: dict[str, ast.Module]) -> list[str]:
    """``module: names`` for every private module (last part ``_x``, not a dunder) whose ``__all__`` is not empty."""
    found = []
    for name, tree in modules.items():
        last = name.rpartition(".")[2]
        if last.startswith("_") and not last.startswith("__") and _all_of(tree):
            found.append(f"{name}: {_all_of(tree)}")
    return sorted(found)


def test_the_surface_checks_see_a_planted_export():
    planted = {"ds_odc.zero._helpers": ast.parse("__all__ = ['helper']\ndef helper(): pass\n"),
               "ds_odc.zero._quiet": ast.parse("__all__: list[str] = []\n"),
               "ds_odc.__main__": ast.parse("__all__ = ['main']\n"),
               "ds_odc.zero.engine": ast.parse("__all__ = ['is_odc', 'wait_seconds']\n")}
    assert _private_modules_exporting(planted) == ["ds_odc.zero._helpers: ['helper']"]
    assert _exported_count(planted) == 4
    too_many = {f"ds_odc.m{i}": ast.parse("__all__ = ['a', 'b']\n") for i in range(MAX_EXPORTED // 2 + 1)}
    assert _exported_count(too_many) > MAX_EXPORTED


def test_private_modules_export_nothing():
    exporting = _private_modules_exporting(_modules())
    assert not exporting, (f"{exporting}: a private module's names are for its package only; set its __all__ to [] "
                           "(a user-facing name belongs in a public module, re-exported lazily if need be)")


def test_the_public_surface_stays_small():
    count = _exported_count(_modules())
    assert count <= MAX_EXPORTED, (f"{count} names in __all__ across ds_odc/ (at most {MAX_EXPORTED}): keep in __all__ "
                                   "only what users import (docs, examples, benchmarks) and the module's documented API")


# -- docs/ARCHITECTURE.md names every module ------------------------------------------------------------------------
# Its table "Each module's one concept" has a row for every file of the package (Python modules and the CUDA sources),
# named by its path inside ds_odc/ in backticks in the first cell, and for nothing else.
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
MODULE_TABLE_HEADER = "| module | its one concept |"
SOURCE_SUFFIXES = (".py", ".cu", ".cpp")


def _module_table(text: str) -> set[str]:
    """The paths named in the first cell of each row of the module table."""
    lines = text.splitlines()
    start = lines.index(MODULE_TABLE_HEADER)
    named = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        named |= set(re.findall(r"`([^`]+)`", line.strip("|").split("|")[0]))
    return named


def _package_files() -> set[str]:
    """Every source file of the package, ``csrc/`` (a link to the checkout's) included."""
    import os
    return {(Path(folder) / name).relative_to(PACKAGE).as_posix()
            for folder, _, names in os.walk(PACKAGE, followlinks=True) for name in names
            if name.endswith(SOURCE_SUFFIXES) and "__pycache__" not in folder}


def _table_gaps(files: set[str], named: set[str]) -> list[str]:
    return ([f"no row for {f}" for f in sorted(files - named)]
            + [f"a row for {f}, which does not exist" for f in sorted(named - files)])


def test_the_module_table_check_sees_a_missing_and_a_stale_row():
    text = ARCHITECTURE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `zero/norms.py` |"))
    named = _module_table(text.replace(row + "\n", ""))
    assert _table_gaps(_package_files(), named) == ["no row for zero/norms.py"]
    stale = text.replace(row, row + "\n| `zero/old.py` | gone |")
    assert _table_gaps(_package_files(), _module_table(stale)) == ["a row for zero/old.py, which does not exist"]


def test_architecture_names_every_module():
    gaps = _table_gaps(_package_files(), _module_table(ARCHITECTURE.read_text()))
    assert not gaps, (f"docs/ARCHITECTURE.md, table {MODULE_TABLE_HEADER!r}: {gaps}; give each module one row "
                      "saying its one concept")
